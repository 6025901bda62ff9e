"""Decode attention on CPUs with AVX2 (avx2/decode_attention.cpp): each row's one new token over its paged
context, read through the block table in the torch backend's cache layout [blocks, block_size, KV heads, D];
float32 or bfloat16 caches (not fp8), head dims a multiple of 8."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import avx2_extension, avx2_supported

__all__ = ["avx2_supported", "decode_attention"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q [rows, heads, D] -> [rows, heads, D]; row i attends to its first seq_lens[i] positions (the last
    `window` of them with a sliding window)."""
    return avx2_extension().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0)
