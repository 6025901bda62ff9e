"""Segmented gather matrix multiply (punica's SGMV) for batched LoRA: the tokens of a step come in segments of
consecutive rows that share an adapter slot, and each segment is multiplied by its own slot's matrix.

    y[start:start+len] (+)= x[start:start+len] @ w[slot]        for each segment (start, len, slot)

One kernel does both halves of a LoRA delta: the shrink (x [T, in] @ A [slots, in, R] -> s [T, R]) and the
expand with accumulation (s @ B [slots, R, out] added into y [T, out]). Rows outside every segment are left
untouched. fp32 accumulation; the output keeps y's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, K, N,
                 stride_xm, stride_xk, stride_ws, stride_wk, stride_wn, stride_ym, stride_yn,
                 ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < length  # programs past a short segment's end do masked (empty) work
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + (start + rows)[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + slot * stride_ws + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
    y_ptrs = y_ptr + (start + rows)[:, None] * stride_ym + cols[None, :] * stride_yn
    mask = row_ok[:, None] & (cols[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _check(x, w, y, seg_start, seg_len, seg_slot) -> None:
    if x.dim() != 2 or w.dim() != 3 or y.dim() != 2:
        raise ValueError(f"x [T, K], w [slots, K, N], y [T, N] expected, got {x.shape}, {w.shape}, {y.shape}")
    if x.shape[1] != w.shape[1] or y.shape[1] != w.shape[2] or y.shape[0] != x.shape[0]:
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, w {tuple(w.shape)}, y {tuple(y.shape)}")
    if not (seg_start.shape == seg_len.shape == seg_slot.shape) or seg_start.dim() != 1:
        raise ValueError("seg_start, seg_len and seg_slot must be 1-D tensors of one length")
    if not (x.device == w.device == y.device == seg_start.device):
        raise ValueError("every tensor must be on one device")


def sgmv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
         seg_slot: torch.Tensor, max_seg_len: int, accumulate: bool) -> torch.Tensor:
    """y[seg] = x[seg] @ w[slot] (or += with `accumulate`) for every segment; returns y."""
    _check(x, w, y, seg_start, seg_len, seg_slot)
    if seg_start.numel() == 0 or max_seg_len == 0:
        return y
    K, N = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(N)))
    grid = (seg_start.numel(), triton.cdiv(max_seg_len, 16), triton.cdiv(N, block_n))
    _sgmv_kernel[grid](x, w, y, seg_start, seg_len, seg_slot, K, N, x.stride(0), x.stride(1),
                       w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
                       ACCUMULATE=accumulate, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32)
    return y


def reference_sgmv(x, w, y, seg_start, seg_len, seg_slot, accumulate: bool) -> torch.Tensor:
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()):
        part = (x[start:start + length].float() @ w[slot].float())
        if accumulate:
            part += y[start:start + length].float()
        y[start:start + length] = part.to(y.dtype)
    return y
