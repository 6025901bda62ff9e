"""Reference attention in plain torch (CPU or GPU): a batched gather + SDPA for decode rows, per-row SDPA
for prefill rows; with soft-capped scores (Gemma 2) the same through an explicit softmax (SDPA has no cap)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.kv_quant import UNIT_SCALES, KVScales, as_bytes, is_fp8, quantize, round_trip
from pagedllm.attention.metadata import AttentionMetadata


def stored_tokens(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """Which tokens have a cache slot, or None when all do: decode graphs' padding rows (slot -1) are stored
    nowhere."""
    return slot_mapping >= 0 if slot_mapping.numel() and int(slot_mapping.min()) < 0 else None


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             scales: KVScales = UNIT_SCALES, stored: torch.Tensor | None = None) -> None:
    """k, v [tokens, KVH, D] into their slots; `stored` (stored_tokens) picks the tokens that have one."""
    kvh, d = k.shape[1], k.shape[2]
    if stored is not None:
        k, v, slot_mapping = k[stored], v[stored], slot_mapping[stored]
    if is_fp8(kv_cache):  # torch has no index_copy_ for float8 on CPU: copy the bytes
        as_bytes(kv_cache[0]).view(-1, kvh, d).index_copy_(0, slot_mapping, as_bytes(quantize(k, scales.k)))
        as_bytes(kv_cache[1]).view(-1, kvh, d).index_copy_(0, slot_mapping, as_bytes(quantize(v, scales.v)))
        return
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


class _Gather:
    """One layer's reads of its cache in a step: blocks gathered into reusable buffers, and for an fp8 cache
    turned back into the query's dtype."""

    def __init__(self, ws: Workspace, kv_cache: torch.Tensor, scales: KVScales, like: torch.Tensor) -> None:
        self.ws, self.kv_cache, self.scales, self.like = ws, kv_cache, scales, like

    def as_cached(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh prompt's own K/V as the cache holds them (an fp8 cache's rounding), for it to attend to."""
        if not is_fp8(self.kv_cache):
            return k, v
        return round_trip(k, self.scales.k), round_trip(v, self.scales.v)

    def __call__(self, which: int, name: str, block_table: torch.Tensor) -> torch.Tensor:
        cache = self.kv_cache[which]
        rows, nb = block_table.shape
        shape = (rows, nb * cache.shape[1], *cache.shape[2:])
        if not is_fp8(cache):
            return gather_kv(cache, block_table, self.ws.get(name, shape, self.like))
        raw = gather_kv(as_bytes(cache), block_table, self.ws.get(name + "8", shape, as_bytes(cache)))
        out = self.ws.get(name, shape, self.like)
        out.copy_(raw.view(cache.dtype))
        scale = self.scales.k if which == 0 else self.scales.v
        return out if scale == 1.0 else out.mul_(scale)


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        self.ws = Workspace()
        self.softcap: float | None = None  # this forward call's (set per call; layers may differ)

    @staticmethod
    def store_kv(k, v, kv_cache, slot_mapping, scales: KVScales = UNIT_SCALES) -> None:
        store_kv(k, v, kv_cache, slot_mapping, scales, stored_tokens(slot_mapping))

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None, softcap: float | None = None,
                kv_scales: KVScales = UNIT_SCALES) -> torch.Tensor:
        self.softcap = softcap
        self._store_step(k, v, kv_cache, meta, kv_scales)
        gather = _Gather(self.ws, kv_cache, kv_scales, q)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], gather, meta, scale, sliding_window)
        for row in range(nd, meta.num_rows):
            s, e = meta.query_start_loc[row], meta.query_start_loc[row + 1]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], gather, meta, row, scale, sliding_window)
        return out

    def _store_step(self, k, v, kv_cache, meta: AttentionMetadata, scales: KVScales) -> None:
        if "torch_stored" not in meta.backend_cache:  # one host sync per step, not per layer
            meta.backend_cache["torch_stored"] = stored_tokens(meta.slot_mapping)
        store_kv(k, v, kv_cache, meta.slot_mapping, scales, meta.backend_cache["torch_stored"])

    def _decode(self, q, gather, meta, scale, window):
        """Decode rows, in a few groups of neighbouring context lengths (the runner orders decode rows by
        length): each group is gathered padded only to its own longest row."""
        nd = meta.num_decodes
        groups = min(_DECODE_GROUPS, max(1, nd // _MIN_GROUP_ROWS))
        bounds = [nd * g // groups for g in range(groups + 1)]
        if groups == 1:
            return self._decode_rows(q, gather, meta, 0, nd, scale, window)
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:]):
            out[a:b] = self._decode_rows(q[a:b], gather, meta, a, b, scale, window)
        return out

    def _decode_rows(self, q, gather, meta, a, b, scale, window):
        """Rows a..b at once: gather their blocks (padded to the longest), mask the padding."""
        bs = meta.block_size
        nb = -(-max(meta.seq_lens_list[a:b]) // bs)
        bt = meta.block_tables[a:b, :nb]
        L = nb * bs
        # [n, L, KVH, D] gathered; SDPA reads it through a transposed view: no copy into [n, KVH, L, D].
        keys = gather(0, "keys", bt).transpose(1, 2)
        vals = gather(1, "vals", bt).transpose(1, 2)
        pos = torch.arange(L, device=q.device)
        lens = meta.seq_lens[a:b, None]
        mask = pos[None, :] < lens
        if window is not None:
            mask &= pos[None, :] > lens - 1 - window
        o = self._attend(q.unsqueeze(2), keys, vals, mask[:, None, None, :], scale)
        return o.squeeze(2)

    def _prefill(self, q, k, v, gather, meta, row, scale, window):
        ctx, qlen, bs = meta.seq_lens_list[row], q.shape[0], meta.block_size
        if ctx == qlen:  # nothing cached before this chunk: attend over the fresh k/v directly
            keys, vals = gather.as_cached(k, v)
        else:
            bt = meta.block_tables[row, :-(-ctx // bs)]
            keys = gather(0, "pk", bt[None])[0, :ctx]
            vals = gather(1, "pv", bt[None])[0, :ctx]
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
