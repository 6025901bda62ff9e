"""Attention kernels for CPUs with AVX2, in the torch backend's cache layout [blocks, block_size, KV heads, D]:
decode (avx2/decode_attention.cpp), each row's one new token over its paged context read through the block
table, from caches of q's dtype or float8_e4m3fn (the fp8 cache, with its per-tensor K and V scales); and the
store into an fp8 cache (avx2/kv_store.cpp). Head dims a multiple of 8."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import avx2_extension, avx2_supported

__all__ = ["avx2_supported", "decode_attention", "store_kv_fp8"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q [rows, heads, D] -> [rows, heads, D]; row i attends to its first seq_lens[i] positions (the last
    `window` of them with a sliding window); an fp8 cache's elements read back as element * k_scale (v_scale)."""
    return avx2_extension().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0,
                                             k_scale, v_scale)


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v [tokens, KV heads, D] (bf16 or fp32) as e4m3 of k / k_scale and v / v_scale into their slots of the
    float8_e4m3fn caches (torch's float8 conversion of the clamped values, bit for bit for finite values); slot -1
    is skipped."""
    avx2_extension().store_kv_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
