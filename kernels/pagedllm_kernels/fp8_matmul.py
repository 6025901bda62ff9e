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


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    tile, lane = rn // 16, rn % 16
    kp = tl.arange(0, BLOCK_KP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for p0 in range(0, K // 2, BLOCK_KP):
        pairs = p0 + kp
        ok = n_ok[None, :] & (pairs < K // 2)[:, None]
        at = ((tile[None, :] * (K // 2) + pairs[:, None]) * 16 + lane[None, :]) * 2
        w0 = e4m3_to_f32(tl.load(w_ptr + at, mask=ok, other=0))
        w1 = e4m3_to_f32(tl.load(w_ptr + at + 1, mask=ok, other=0))
        x_ok = m_ok[:, None] & (pairs < K // 2)[None, :]
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * pairs[None, :], mask=x_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * pairs[None, :] + 1, mask=x_ok,
                        other=0.0).to(tl.float32)
        if IEEE:
            acc += tl.dot(x_even, w0, input_precision="ieee") + tl.dot(x_odd, w1, input_precision="ieee")
        else:  # tf32 holds e4m3 values and bf16 x exactly
            acc += tl.dot(x_even, w0) + tl.dot(x_odd, w1)
    acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype; packed/scales in fp8_layout.py's layout; bias float32 [N] or None."""
    tiles, pairs = packed.shape[:2]
    n, k = tiles * TILE, pairs * 2
    if x.dim() != 2 or x.shape[1] != k or packed.shape[2:] != (TILE, 2) or scales.numel() != n:
        raise ValueError(f"x {tuple(x.shape)} does not fit a packed weight {tuple(packed.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    block_m = 16 if x.shape[0] <= 16 else 32
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, 64))
    _fp8_matmul_kernel[grid](x, packed.view(torch.uint8), scales, bias if bias is not None else scales, y,
                             x.shape[0], n, k, x.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=64, BLOCK_KP=16,
                             HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32)
    return y


def reference_fp8_matmul(x, packed, scales, bias=None) -> torch.Tensor:
    y = x.float() @ dequantize(packed, scales).to(x.device).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
