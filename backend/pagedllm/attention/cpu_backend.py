"""CPU attention through our AVX-512 paged kernel, which reads K/V in place through the block table.

The cache blocks are arranged for the kernel's dot products (pagedllm_kernels/cpu/kv_layout.py), so this
backend writes them with its own store kernel. One kernel call per layer serves the mixed batch (decodes, whole
prompts, chunks after cached positions): this step's K/V are stored first, then each row's tokens attend
causally to its context, a prompt's tokens a tile at a time over each block while it is in cache. Measured
faster than torch's fused causal SDPA on whole prompts (perf/attention_share.py). An fp8 cache (with a bf16
model) is read by the same kernel, its bytes widened to bf16 pairs as they load, so fresh prompts too attend
to the values the cache holds. On CPUs with AMX, prompts' tiles run on the tile unit (attention_amx.h: 3.7-4.1x
the AVX-512 path's speed on 512- and 1,500-token prompts, perf/README.md, session 28), and so do decodes where a
KV head has 5 or more query heads (session 29); other decodes stay on AVX-512.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_quant import UNIT_SCALES, KVScales, is_fp8
from pagedllm.attention.metadata import AttentionMetadata


class CpuAttention:
    name = "cpu"

    def __init__(self, amx: bool | None = None) -> None:
        """`amx`: prompts (and wide groups' decodes) on the AMX tile unit (None: where the CPU has one;
        EngineConfig.amx_attention=False builds it with False, before the backends' race)."""
        from pagedllm_kernels.cpu import kv_layout
        from pagedllm_kernels.cpu import paged_attention as kernel

        ok, why = kernel.cpu_supported()
        if not ok:
            raise RuntimeError(why)
        self._kernel, self._layout = kernel, kv_layout
        self.amx = kernel.amx_supported()[0] if amx is None else amx

    def warm_up(self, device: str) -> None:
        """Compile (or load the cached build of) the kernel; only for CPU engines, so GPU hosts skip it."""
        if device != "cpu":
            raise RuntimeError(f"a CPU kernel; the engine runs on {device}")
        self._kernel.load_kernel()

    def store_kv(self, k, v, kv_cache, slot_mapping, scales: KVScales = UNIT_SCALES) -> None:
        self._layout.store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping, scales.k, scales.v)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                softcap: float | None = None, kv_scales: KVScales = UNIT_SCALES):
        if softcap is not None:
            raise NotImplementedError(f"{self.name}: attention-logit soft-capping is not supported")
        if is_fp8(kv_cache) and q.dtype != torch.bfloat16:
            raise NotImplementedError(f"{self.name}: an fp8 KV cache needs a bfloat16 model, not {q.dtype}")
        self.store_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self._kernel.paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, scale,
                                            sliding_window, kv_scales.k, kv_scales.v,
                                            query_start_loc=self.query_starts(meta), amx=self.amx)

    @staticmethod
    def query_starts(meta: AttentionMetadata) -> torch.Tensor:
        """The step's query starts as the kernel takes them (int64), made by the step's first layer and reused."""
        starts = meta.backend_cache.get("cpu_query_start")
        if starts is None:
            starts = meta.backend_cache["cpu_query_start"] = meta.query_start_loc_t.long()
        return starts
