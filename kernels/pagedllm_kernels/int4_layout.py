"""The int4 weight layout our int4 kernels read (the CPU one in cpu/quantized_linear.cpp, the Triton one in
int4_matmul.py), made once at load from a checkpoint's codes, zeros and scales, and its torch reference.

    packed [N/16, K/2, 16] uint8   per tile of 16 output columns and pair of input rows (k, k + 1): one byte
                                   per column, k's code in the low nibble, k + 1's in the high nibble
    scales [N/16, G, 16] float32   per tile and group, the 16 columns' scales s
    mins   [N/16, G, 16] float32   and s * zero, so W[n, k] = s * code - min

Groups are contiguous runs of group_size input rows (a GPTQ desc_act checkpoint's rows are permuted at load
so that they are, and the layer permutes its input the same way).
"""

from __future__ import annotations

import torch

from pagedllm_kernels import huge_pages

TILE = 16


def check_shapes(out_features: int, in_features: int, group_size: int) -> None:
    if out_features % TILE:
        raise ValueError(f"int4: output features {out_features} must be a multiple of {TILE}")
    if group_size % 32 or in_features % group_size:
        raise ValueError(f"int4: group size {group_size} must be a multiple of 32 dividing {in_features} inputs")


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """codes [N, K] uint8 (0..15), scales and zeros [N, G] -> (packed, scales, mins) in this layout."""
    n, k = codes.shape
    check_shapes(n, k, group_size)
    pairs = codes.view(n // TILE, TILE, k // 2, 2)
    packed = huge_pages.copy_of((pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 1))  # [N/16, K/2, 16]
    s = scales.float()
    m = s * zeros.float()
    tiles = lambda t: t.view(n // TILE, TILE, -1).permute(0, 2, 1).contiguous()  # noqa: E731
    return packed, tiles(s), tiles(m)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: the [N, K] weight."""
    tiles, pairs, _ = packed.shape
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)  # [N/16, K/2, 16, 2]
    codes = codes.permute(0, 2, 1, 3).reshape(tiles * TILE, pairs * 2).float()
    s = scales.permute(0, 2, 1).reshape(tiles * TILE, -1).repeat_interleave(group_size, dim=1)
    m = mins.permute(0, 2, 1).reshape(tiles * TILE, -1).repeat_interleave(group_size, dim=1)
    return (codes * s - m).to(dtype)
