"""Weight-only int4 matmul in Triton: y = x W^T (+ b), the weight read packed (int4_layout.py) and
dequantized inside the loop, never stored. Tested under TRITON_INTERPRET=1 on CPU.

Each program computes a BLOCK_M x BLOCK_N tile of y. Each step takes 2 * BLOCK_KP input rows, all in one
group (group sizes are multiples of 32): the bytes' low nibbles (even input rows) and high nibbles (odd rows)
are two [BLOCK_KP, BLOCK_N] code matrices, multiplied by x's even and odd columns; with the group's scales s
and mins m,  y += s * (x_even codes_lo + x_odd codes_hi) - m * sum(x over the step's rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm_kernels.int4_layout import TILE, dequantize


@triton.jit
def _int4_matmul_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, G, stride_xm, stride_ym,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_KP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
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
        wb = tl.load(w_ptr + (tile[None, :] * (K // 2) + pairs[:, None]) * 16 + lane[None, :],
                     mask=n_ok[None, :], other=0).to(tl.int32)
        # fp32 operands: tf32 products are exact for bf16 x and for the codes 0..15
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * pairs[None, :], mask=m_ok[:, None],
                         other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * pairs[None, :] + 1, mask=m_ok[:, None],
                        other=0.0).to(tl.float32)
        lo = (wb & 0xF).to(tl.float32)
        hi = (wb >> 4).to(tl.float32)
        if IEEE:
            part = tl.dot(x_even, lo, input_precision="ieee") + tl.dot(x_odd, hi, input_precision="ieee")
        else:
            part = tl.dot(x_even, lo) + tl.dot(x_odd, hi)
        g = (2 * p0) // GROUP
        sg = tl.load(s_ptr + (tile * G + g) * 16 + lane, mask=n_ok, other=0.0)
        mg = tl.load(m_ptr + (tile * G + g) * 16 + lane, mask=n_ok, other=0.0)
        xsum = tl.sum(x_even, 1) + tl.sum(x_odd, 1)
        acc += part * sg[None, :] - xsum[:, None] * mg[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16) -> [M, N] in x's dtype; bias float32 [N] or None."""
    tiles, pairs, lanes = packed.shape
    n, k = tiles * TILE, pairs * 2
    if x.dim() != 2 or x.shape[1] != k or lanes != TILE:
        raise ValueError(f"x {tuple(x.shape)} does not fit a packed weight {tuple(packed.shape)}")
    if group_size % 32 or k % group_size or scales.shape != (tiles, k // group_size, TILE) or \
            mins.shape != scales.shape:
        raise ValueError(f"scales {tuple(scales.shape)} and group size {group_size} do not fit {n} x {k}")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    block_m = 16 if x.shape[0] <= 16 else 32
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, 64))
    _int4_matmul_kernel[grid](
        x, packed, scales, mins, bias if bias is not None else scales, y, x.shape[0], n, k, k // group_size,
        x.stride(0), y.stride(0), GROUP=group_size, BLOCK_M=block_m, BLOCK_N=64, BLOCK_KP=16,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32)
    return y


def reference_int4_matmul(x, packed, scales, mins, group_size, bias=None) -> torch.Tensor:
    y = x.float() @ dequantize(packed, scales, mins, group_size).to(x.device).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
