"""Reference attention in plain torch (CPU or GPU): a batched gather + SDPA for decode rows, per-row SDPA
for prefill rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kvh, d = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_blocks, bs, KVH, D] cache, [..., nb] block ids -> [..., nb*bs, KVH, D] (first num_tokens valid)."""
    g = cache[block_table]
    return g.reshape(*block_table.shape[:-1], -1, cache.shape[-2], cache.shape[-1])


class TorchAttention:
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, sliding_window)
        for row in range(nd, meta.num_rows):
            s, e = meta.query_start_loc[row], meta.query_start_loc[row + 1]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], kv_cache, meta, row, scale, sliding_window)
        return out

    def _decode(self, q, kv_cache, meta, scale, window):
        nd, bs = meta.num_decodes, meta.block_size
        max_len = max(meta.seq_lens_list[:nd])
        nb = -(-max_len // bs)
        bt = meta.block_tables[:nd, :nb]
        keys = gather_kv(kv_cache[0], bt, max_len).transpose(1, 2)  # [nd, KVH, L, D]
        vals = gather_kv(kv_cache[1], bt, max_len).transpose(1, 2)
        pos = torch.arange(nb * bs, device=q.device)
        lens = meta.seq_lens[:nd, None]
        mask = pos[None, :] < lens
        if window is not None:
            mask &= pos[None, :] > lens - 1 - window
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        return o.squeeze(2)

    def _prefill(self, q, k, v, kv_cache, meta, row, scale, window):
        ctx, qlen, bs = meta.seq_lens_list[row], q.shape[0], meta.block_size
        if ctx == qlen:  # nothing cached before this chunk: attend over the fresh k/v directly
            keys, vals = k, v
        else:
            nb = -(-ctx // bs)
            bt = meta.block_tables[row, :nb]
            keys = gather_kv(kv_cache[0], bt, ctx)[:ctx]
            vals = gather_kv(kv_cache[1], bt, ctx)[:ctx]
        qt, kt, vt = q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
        if window is None and ctx == qlen:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(0, 1)
