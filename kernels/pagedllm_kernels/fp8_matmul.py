"""fp8 (e4m3) weights in Triton: y = x (W * s)^T (+ b), the weight read as bytes in fp8_layout.py's layout and
widened inside the loop (e4m3.py: no fp8 hardware needed, tested under TRITON_INTERPRET=1), each column's
scale applied to its sum. Each step takes BLOCK_KP pairs of input rows: the pairs' first and second elements
are two [BLOCK_KP, BLOCK_N] matrices, multiplied by x's even and odd columns."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm_kernels.e4m3 import e4m3_to_f32
from pagedllm_kernels.fp8_layout import TILE, dequantize
from pagedllm_kernels.weight_tiles import launch, output_tile, pair_dots, store_tile, x_pairs


@triton.jit
def _fp8_matmul_kernel(x_ptr, y_ptr, b_ptr, M, N, K, stride_xm, stride_ym, w_ptr, s_ptr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    rm, rn, m_ok, n_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    tile, lane = rn // 16, rn % 16
    kp = tl.arange(0, BLOCK_KP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for p0 in range(0, K // 2, BLOCK_KP):
        pairs = p0 + kp
        ok = n_ok[None, :] & (pairs < K // 2)[:, None]
        at = ((tile[None, :] * (K // 2) + pairs[:, None]) * 16 + lane[None, :]) * 2
        w0 = e4m3_to_f32(tl.load(w_ptr + at, mask=ok, other=0))
        w1 = e4m3_to_f32(tl.load(w_ptr + at + 1, mask=ok, other=0))
        x_even, x_odd = x_pairs(x_ptr, rm, stride_xm, pairs, m_ok[:, None] & (pairs < K // 2)[None, :])
        acc += pair_dots(x_even, x_odd, w0, w1, IEEE)
    acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    store_tile(y_ptr, b_ptr, acc, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS)


def fp8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype; packed/scales in fp8_layout.py's layout; bias float32 [N] or None."""
    tiles, pairs = packed.shape[:2]
    n, k = tiles * TILE, pairs * 2
    if x.dim() != 2 or x.shape[1] != k or packed.shape[2:] != (TILE, 2) or scales.numel() != n:
        raise ValueError(f"x {tuple(x.shape)} does not fit a packed weight {tuple(packed.shape)}")
    return launch(_fp8_matmul_kernel, x, n, bias, packed.view(torch.uint8), scales)


def reference_fp8_matmul(x, packed, scales, bias=None) -> torch.Tensor:
    y = x.float() @ dequantize(packed, scales).to(x.device).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
