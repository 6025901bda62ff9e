"""The fp8 (e4m3) weight layout our fp8 kernels read (the CPU one in cpu/quantized_linear.cpp, the Triton one
in fp8_matmul.py), and its torch reference.

    packed [N/16, K/2, 16, 2] float8_e4m3fn   per tile of 16 output columns and pair of input rows (k, k + 1):
                                              column j's two elements side by side
    scales [N/16, 1, 16] float32              each column's scale: W[n, k] = element * scale[n]
"""

from __future__ import annotations

import torch

from pagedllm_kernels import huge_pages

TILE = 16


def check_shapes(out_features: int, in_features: int) -> None:
    if out_features % TILE or in_features % 2:
        raise ValueError(f"fp8 weights: output features {out_features} must be a multiple of {TILE} and input "
                         f"features {in_features} even")


def arrange(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] of any dtype -> [N/16, K/2, 16, 2]: this layout's arrangement (also the dense bf16 kernel's,
    cpu/bf16_tiles.py)."""
    n, k = weight.shape
    return huge_pages.copy_of(weight.view(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3))  # streamed whole per step


def unarrange(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of arrange: [N/16, K/2, 16, 2] -> [N, K]."""
    tiles, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE, pairs * 2)


def pack(weight: torch.Tensor, scales: torch.Tensor):
    """weight [N, K] float8_e4m3fn, scales [N] -> (packed, scales) in this layout."""
    n, k = weight.shape
    check_shapes(n, k)
    return arrange(weight), scales.float().reshape(n // TILE, 1, TILE).contiguous()


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: the [N, K] weight (element * scale, in fp32, then rounded to dtype)."""
    return (unarrange(packed).float() * scales.reshape(-1, 1)).to(dtype)
