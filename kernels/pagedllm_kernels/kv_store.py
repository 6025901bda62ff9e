"""KV store: write this step's K and V into their cache slots. Slot -1 marks padding and is skipped.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block_id * block_size + offset.
Into an fp8 (float8_e4m3fn) cache the kernel writes the e4m3 codes of K / k_scale and V / v_scale itself
(e4m3.py), in the one pass that copies them: what torch's quantize-then-copy takes four passes for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm_kernels.e4m3 import f32_to_e4m3

FP8 = torch.float8_e4m3fn


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     FP8_CACHE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d  # head_dim is contiguous (checked)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8_CACHE:  # div_rn: IEEE division, as the C++ stores and torch on CPU (a GPU's default fp32 divide is not)
        k = f32_to_e4m3(tl.math.div_rn(k.to(tl.float32), k_scale))
        v = f32_to_e4m3(tl.math.div_rn(v.to(tl.float32), v_scale))
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must be [tokens, kv_heads, head_dim] of one shape, got {k.shape}, {v.shape}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches must be [blocks, block_size, {k.shape[1]}, {k.shape[2]}], got {k_cache.shape}")
    if k.dtype != v.dtype or k.dtype == FP8 or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (k.dtype, FP8):
        raise ValueError("k and v must share a dtype (not float8_e4m3fn: the store rounds to it), and the caches "
                         "either it or float8_e4m3fn")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be [tokens] int32/int64")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head_dim axis must be contiguous")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The scales apply to an fp8 cache only (a cached element is value / scale)."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    fp8 = k_cache.dtype == FP8
    if fp8:  # written as bytes: Triton stores the codes it computes, not float8 values
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _kv_store_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], FP8_CACHE=fp8)


def reference_kv_store(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    if k_cache.dtype == FP8:  # torch has no index_put for float8 on CPU: copy the bytes
        k = (k.float() / k_scale).clamp(-448, 448).to(FP8).view(torch.uint8)
        v = (v.float() / v_scale).clamp(-448, 448).to(FP8).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v
