"""CPU attention for hosts with AVX2 but no AVX-512 (where the `cpu` backend's kernel cannot run): the torch
backend, with its decode rows sent to our AVX2 kernel (pagedllm_kernels/cpu/avx2_attention.py), which reads
each row's context in place through its block table instead of gathering padded copies for SDPA. On the 2-core
Zen 3 host, 8 decode rows of 384 tokens (12 heads of 64) took 1.5 ms a layer against torch SDPA's 5.1 in bf16.
An fp8 cache is written by our AVX2 store kernel (K/V rounded to e4m3 over their scales in one pass) and read
as it lies (e4m3 widened in the kernel, its scales folded in). Prompts and chunks go
through the torch backend's SDPA as before, and so do decodes of soft-capped scores or of head dims that are
not a multiple of 8.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_quant import UNIT_SCALES, KVScales, is_fp8
from pagedllm.attention.torch_backend import TorchAttention


class Avx2Attention(TorchAttention):
    name = "avx2"

    def __init__(self) -> None:
        super().__init__()
        from pagedllm_kernels.cpu import avx2_attention

        ok, why = avx2_attention.avx2_supported()
        if not ok:
            raise RuntimeError(why)
        self._kernel = avx2_attention

    def warm_up(self, device: str) -> None:
        """Load (or build) the kernels' module; only for CPU engines."""
        if device != "cpu":
            raise RuntimeError(f"a CPU kernel; the engine runs on {device}")
        from pagedllm_kernels.cpu.build import avx2_extension

        avx2_extension()

    @staticmethod
    def _kernel_stores(k, kv_cache) -> bool:
        return is_fp8(kv_cache) and k.dtype in (torch.bfloat16, torch.float32) and k.shape[-1] % 8 == 0

    def store_kv(self, k, v, kv_cache, slot_mapping, scales: KVScales = UNIT_SCALES) -> None:
        if self._kernel_stores(k, kv_cache):
            self._kernel.store_kv_fp8(k, v, kv_cache[0], kv_cache[1], slot_mapping, scales.k, scales.v)
        else:
            super().store_kv(k, v, kv_cache, slot_mapping, scales)

    def _store_step(self, k, v, kv_cache, meta, scales: KVScales) -> None:
        if self._kernel_stores(k, kv_cache):  # padding's -1 slots skipped in the kernel: no host sync for them
            self.store_kv(k, v, kv_cache, meta.slot_mapping, scales)
        else:
            super()._store_step(k, v, kv_cache, meta, scales)

    def _decode(self, q, gather, meta, scale, window):
        cache = gather.kv_cache
        if self.softcap is not None or q.shape[-1] % 8:
            return super()._decode(q, gather, meta, scale, window)
        nd = meta.num_decodes
        scales = gather.scales if is_fp8(cache) else UNIT_SCALES
        return self._kernel.decode_attention(q, cache[0], cache[1], meta.block_tables[:nd], meta.seq_lens[:nd],
                                             scale, window, scales.k, scales.v)
