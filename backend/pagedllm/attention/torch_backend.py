"""Reference attention in plain torch (CPU or GPU): a batched gather + SDPA for decode rows, per-row SDPA
for prefill rows; with soft-capped scores (Gemma 2) the same through an explicit softmax (SDPA has no cap)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kvh, d = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v)


# Decode rows are split into at most this many length groups, of at least this many rows each: less padding
# to gather and attend over, for a few more calls.
_DECODE_GROUPS = 4
_MIN_GROUP_ROWS = 8


class Workspace:
    """Reusable scratch buffers. Fresh multi-MB tensors each layer and step would be page-faulted in anew
    every time (large allocations go straight back to the OS), which measured slower than the copies."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape, like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)), dtype=like.dtype,
                              device=like.device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[num_blocks, bs, KVH, D] cache, [rows, nb] block ids -> [rows, nb*bs, KVH, D].
    index_select on the flattened table measures several times faster than advanced indexing on CPU."""
    rows, nb = block_table.shape
    bs, kvh, d = cache.shape[1:]
    flat = block_table.reshape(-1)
    if out is None:
        g = torch.index_select(cache, 0, flat)
    else:
        g = torch.index_select(cache, 0, flat, out=out.view(rows * nb, bs, kvh, d))
    return g.view(rows, nb * bs, kvh, d)


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        self.ws = Workspace()
        self.softcap: float | None = None  # this forward call's (set per call; layers may differ)

    @staticmethod
    def store_kv(k, v, kv_cache, slot_mapping) -> None:
        store_kv(k, v, kv_cache, slot_mapping)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
        self.softcap = softcap
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
        """Decode rows, in a few groups of neighbouring context lengths (the runner orders decode rows by
        length): each group is gathered padded only to its own longest row."""
        nd = meta.num_decodes
        groups = min(_DECODE_GROUPS, max(1, nd // _MIN_GROUP_ROWS))
        bounds = [nd * g // groups for g in range(groups + 1)]
        if groups == 1:
            return self._decode_rows(q, kv_cache, meta, 0, nd, scale, window)
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:]):
            out[a:b] = self._decode_rows(q[a:b], kv_cache, meta, a, b, scale, window)
        return out

    def _decode_rows(self, q, kv_cache, meta, a, b, scale, window):
        """Rows a..b at once: gather their blocks (padded to the longest), mask the padding."""
        n, bs = b - a, meta.block_size
        nb = -(-max(meta.seq_lens_list[a:b]) // bs)
        bt = meta.block_tables[a:b, :nb]
        kvh, d = kv_cache.shape[-2], kv_cache.shape[-1]
        L = nb * bs
        # [n, L, KVH, D] gathered; SDPA reads it through a transposed view: no copy into [n, KVH, L, D].
        keys = gather_kv(kv_cache[0], bt, self.ws.get("keys", (n, L, kvh, d), q)).transpose(1, 2)
        vals = gather_kv(kv_cache[1], bt, self.ws.get("vals", (n, L, kvh, d), q)).transpose(1, 2)
        pos = torch.arange(L, device=q.device)
        lens = meta.seq_lens[a:b, None]
        mask = pos[None, :] < lens
        if window is not None:
            mask &= pos[None, :] > lens - 1 - window
        o = self._attend(q.unsqueeze(2), keys, vals, mask[:, None, None, :], scale)
        return o.squeeze(2)

    def _prefill(self, q, k, v, kv_cache, meta, row, scale, window):
        ctx, qlen, bs = meta.seq_lens_list[row], q.shape[0], meta.block_size
        if ctx == qlen:  # nothing cached before this chunk: attend over the fresh k/v directly
            keys, vals = k, v
        else:
            nb = -(-ctx // bs)
            bt = meta.block_tables[row, :nb]
            keys = gather_kv(kv_cache[0], bt[None], self.ws.get("pk", (nb * bs, *k.shape[1:]), k))[0, :ctx]
            vals = gather_kv(kv_cache[1], bt[None], self.ws.get("pv", (nb * bs, *k.shape[1:]), k))[0, :ctx]
        qt, kt, vt = q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
        if window is None and ctx == qlen and self.softcap is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = self._attend(qt, kt, vt, mask, scale)
        return o.transpose(0, 1)

    def _attend(self, q, k, v, mask, scale):
        """SDPA over q [..., H, Lq, D], k/v [..., KVH, L, D] with a boolean mask; explicitly when scores are
        soft-capped (transformers' eager order: scale, cap, mask, fp32 softmax)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / self.softcap) * self.softcap
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype)
        return weights @ v
