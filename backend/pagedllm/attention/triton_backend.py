"""Attention through our Triton kernels (pagedllm_kernels): KV store, then one paged-attention launch for
the whole mixed batch. Into an fp8 cache the store kernel writes e4m3 codes of K/V over their scales; the
attention kernel widens them as it reads."""

from __future__ import annotations

import torch

from pagedllm.attention.kv_quant import UNIT_SCALES, KVScales
from pagedllm.attention.metadata import AttentionMetadata


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        from pagedllm_kernels.kv_store import kv_store  # ImportError: triton missing
        from pagedllm_kernels.paged_attention import paged_attention

        self._kv_store = kv_store
        self._paged_attention = paged_attention

    def store_kv(self, k, v, kv_cache, slot_mapping, scales: KVScales = UNIT_SCALES) -> None:
        self._kv_store(k, v, kv_cache[0], kv_cache[1], slot_mapping, scales.k, scales.v)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                softcap: float | None = None, kv_scales: KVScales = UNIT_SCALES) -> torch.Tensor:
        if softcap is not None:
            raise NotImplementedError(f"{self.name}: attention-logit soft-capping is not supported")
        self.store_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self._paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc_t, meta.max_query_len, scale, sliding_window,
                                     k_scale=kv_scales.k, v_scale=kv_scales.v)
