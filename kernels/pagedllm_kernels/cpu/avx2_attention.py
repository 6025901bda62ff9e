"""Decode attention on CPUs with AVX2 (avx2/decode_attention.cpp): each row's one new token over its paged
context, read through the block table in the torch backend's cache layout [blocks, block_size, KV heads, D];
caches of q's dtype or float8_e4m3fn (the fp8 cache, with its per-tensor K and V scales), head dims a multiple of 8."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import avx2_extension, avx2_supported

__all__ = ["avx2_supported", "decode_attention"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q [rows, heads, D] -> [rows, heads, D]; row i attends to its first seq_lens[i] positions (the last
    `window` of them with a sliding window); an fp8 cache's elements read back as element * k_scale (v_scale)."""
    return avx2_extension().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0,
                                             k_scale, v_scale)
