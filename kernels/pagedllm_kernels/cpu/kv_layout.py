"""The CPU kernels' KV cache layout (kv_layout.h) and its store kernel (kv_store.cpp), with torch references.

A cache keeps the engine's shape [blocks, block_size, kv_heads, head_dim]; inside each block, per KV head,
K is [head_dim / P][block_size][P] and V is [block_size / P][head_dim][P], in 32-bit units of P elements
(P = 2 for bf16 and for fp8, whose bytes are read as bf16 pairs; 1 for fp32). Only `store_kv` writes it and only
the CPU attention kernel reads it. An fp8 (float8_e4m3fn) cache holds value / scale, rounded and clamped to ±448.
"""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import extension


FP8 = torch.float8_e4m3fn


def unit(dtype: torch.dtype) -> int:
    return 2 if dtype == FP8 else 4 // torch.empty((), dtype=dtype).element_size()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v [tokens, kv_heads, head_dim] into their slots (slot = block * block_size + offset; -1 = skip);
    into an fp8 cache as k / k_scale and v / v_scale."""
    if k.dim() != 3 or k.shape != v.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"{k.shape[0]} tokens but {tuple(slot_mapping.shape)} slots")
    extension().store_kv(k, v, k_cache, v_cache, slot_mapping.long().contiguous(), float(k_scale), float(v_scale))


def to_kernel_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: caches in the plain [blocks, block_size, kv_heads, head_dim] layout -> the kernels' layout."""
    nb, bs, kvh, d = k_cache.shape
    p = unit(k_cache.dtype)
    k = k_cache.view(nb, bs, kvh, d // p, p).permute(0, 2, 3, 1, 4)  # [nb, kvh, d/p, bs, p]
    v = v_cache.view(nb, bs // p, p, kvh, d).permute(0, 3, 1, 4, 2)  # [nb, kvh, bs/p, d, p]
    return k.contiguous().view(nb, bs, kvh, d), v.contiguous().view(nb, bs, kvh, d)


def from_kernel_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the inverse of to_kernel_layout."""
    nb, bs, kvh, d = k_cache.shape
    p = unit(k_cache.dtype)
    k = k_cache.view(nb, kvh, d // p, bs, p).permute(0, 3, 1, 2, 4)  # [nb, bs, kvh, d/p, p]
    v = v_cache.view(nb, kvh, bs // p, d, p).permute(0, 2, 4, 1, 3)  # [nb, bs/p, p, kvh, d]
    return k.contiguous().view(nb, bs, kvh, d), v.contiguous().view(nb, bs, kvh, d)


def reference_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """What store_kv does, through the plain layout."""
    plain_k, plain_v = from_kernel_layout(k_cache, v_cache)
    keep = slot_mapping >= 0
    kvh, d = k.shape[1:]
    if k_cache.dtype == FP8:
        k = (k.float() / k_scale).clamp(-448, 448).to(FP8)
        v = (v.float() / v_scale).clamp(-448, 448).to(FP8)
    plain_k.view(-1, kvh, d)[slot_mapping[keep]] = k[keep]
    plain_v.view(-1, kvh, d)[slot_mapping[keep]] = v[keep]
    new_k, new_v = to_kernel_layout(plain_k, plain_v)
    k_cache.copy_(new_k)
    v_cache.copy_(new_v)
