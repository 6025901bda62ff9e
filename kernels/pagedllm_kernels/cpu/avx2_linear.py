"""bf16 linears on CPUs with AVX2 but no AVX-512 (avx2/bf16_linear.cpp), where oneDNN has no bf16 matmul: the
weight in tiles of 8 output columns, [N/8, K, 8] (the same bytes as [N, K], rearranged), widened to fp32 inside
the kernel, for batches of any size."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import avx2_extension, avx2_supported

__all__ = ["COLS", "avx2_supported", "can_pack", "linear", "pack", "reference", "unpack"]

COLS = 8  # output columns per tile


def can_pack(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[0] % COLS == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (N a multiple of 8) -> [N/8, K, 8]."""
    if not can_pack(weight):
        raise ValueError(f"a bf16 [N, K] weight with N % {COLS} == 0, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    return weight.detach().reshape(n // COLS, COLS, k).transpose(1, 2).contiguous()


def unpack(tiles: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight back from its tiles."""
    return tiles.transpose(1, 2).reshape(-1, tiles.shape[1])


def linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] bf16 -> [rows, N] bf16; bias float32 [N] or None."""
    return avx2_extension().bf16_linear(x, tiles, bias)


def reference(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ unpack(tiles).float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
