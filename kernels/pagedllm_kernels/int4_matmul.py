"""Weight-only int4 matmul in Triton: y = x W^T (+ b), the weight read packed (int4_layout.py) and
dequantized inside the loop, never stored. Tested under TRITON_INTERPRET=1 on CPU.

Each program computes a BLOCK_M x BLOCK_N tile of y (weight_tiles.py). Each step takes 2 * BLOCK_KP input rows, all in one
group (group sizes are multiples of 32): the bytes' low nibbles (even input rows) and high nibbles (odd rows)
are two [BLOCK_KP, BLOCK_N] code matrices, multiplied by x's even and odd columns; with the group's scales s
and mins m,  y += s * (x_even codes_lo + x_odd codes_hi) - m * sum(x over the step's rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm_kernels.int4_layout import TILE, dequantize
from pagedllm_kernels.weight_tiles import launch, output_tile, pair_dots, store_tile, x_pairs


@triton.jit
def _int4_matmul_kernel(x_ptr, y_ptr, b_ptr, M, N, K, stride_xm, stride_ym, w_ptr, s_ptr, m_ptr, G,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr):
    rm, rn, m_ok, n_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    tile, lane = rn // 16, rn % 16
    kp = tl.arange(0, BLOCK_KP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for p0 in range(0, K // 2, BLOCK_KP):
        pairs = p0 + kp  # always within K: K is a multiple of the group size, so of 2 * BLOCK_KP
        wb = tl.load(w_ptr + (tile[None, :] * (K // 2) + pairs[:, None]) * 16 + lane[None, :],
                     mask=n_ok[None, :], other=0).to(tl.int32)
        x_even, x_odd = x_pairs(x_ptr, rm, stride_xm, pairs, m_ok[:, None])
        part = pair_dots(x_even, x_odd, (wb & 0xF).to(tl.float32), (wb >> 4).to(tl.float32), IEEE)
        g = (2 * p0) // GROUP
        sg = tl.load(s_ptr + (tile * G + g) * 16 + lane, mask=n_ok, other=0.0)
        mg = tl.load(m_ptr + (tile * G + g) * 16 + lane, mask=n_ok, other=0.0)
        xsum = tl.sum(x_even, 1) + tl.sum(x_odd, 1)
        acc += part * sg[None, :] - xsum[:, None] * mg[None, :]
    store_tile(y_ptr, b_ptr, acc, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS)


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
    return launch(_int4_matmul_kernel, x, n, bias, packed, scales, mins, k // group_size, GROUP=group_size)


def reference_int4_matmul(x, packed, scales, mins, group_size, bias=None) -> torch.Tensor:
    y = x.float() @ dequantize(packed, scales, mins, group_size).to(x.device).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
