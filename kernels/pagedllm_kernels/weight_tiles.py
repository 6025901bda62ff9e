"""What the Triton quantized-weight matmuls (int4_matmul.py, fp8_matmul.py) share: a program's output tile, x's
even and odd input columns for a step of input-row pairs, their two dots, the bias and the store, and the
launch. Each kernel adds only how its weight bytes become the step's two [BLOCK_KP, BLOCK_N] matrices (the
pairs' first and second input rows) and how its scales apply.

Kernel signature the launch fills: (x_ptr, y_ptr, b_ptr, M, N, K, stride_xm, stride_ym, *weights,
BLOCK_M, BLOCK_N, BLOCK_KP, HAS_BIAS, IEEE, **more constexprs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_KP = 64, 16


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns of y, and which of them exist."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, rm < M, rn < N


@triton.jit
def x_pairs(x_ptr, rm, stride_xm, pairs, mask):
    """x's columns 2p and 2p + 1 for the step's pairs p, in fp32 ([BLOCK_M, BLOCK_KP] each): tf32 holds bf16 x
    exactly, as it does int4 codes and e4m3 values."""
    at = x_ptr + rm[:, None] * stride_xm + 2 * pairs[None, :]
    return tl.load(at, mask=mask, other=0.0).to(tl.float32), tl.load(at + 1, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def pair_dots(x_even, x_odd, w_even, w_odd, IEEE: tl.constexpr):
    """x_even w_even + x_odd w_odd, IEEE fp32 for fp32 models (tf32 otherwise)."""
    if IEEE:
        return tl.dot(x_even, w_even, input_precision="ieee") + tl.dot(x_odd, w_odd, input_precision="ieee")
    return tl.dot(x_even, w_even) + tl.dot(x_odd, w_odd)


@triton.jit
def store_tile(y_ptr, b_ptr, acc, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def launch(kernel, x: torch.Tensor, n: int, bias: torch.Tensor | None, *weights, **constexprs) -> torch.Tensor:
    """y [M, n] in x's dtype; x [M, K] (rows made contiguous if they are not)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    block_m = 16 if x.shape[0] <= 16 else 32
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, BLOCK_N))
    kernel[grid](x, y, bias if bias is not None else y, x.shape[0], n, x.shape[1], x.stride(0), y.stride(0),
                 *weights, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_KP=BLOCK_KP, HAS_BIAS=bias is not None,
                 IEEE=x.dtype == torch.float32, **constexprs)
    return y
