"""bf16 linear layers with AMX tiles (the C++ in amx_linear.cpp): the weight packed once into tile order, a
launcher that checks shapes, and the torch reference (`F.linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm_kernels.cpu.build import amx_supported, extension

__all__ = ["amx_supported", "can_pack", "pack_weight", "linear", "reference"]


def can_pack(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == 0 and k % 32 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32, K/32, 2, 16, 16, 2]: per pair of 16-column panels and 32-wide K step, two B tiles whose
    row r holds the (k, k+1) pairs 2r, 2r+1 of the panel's 16 columns."""
    if not can_pack(weight):
        raise ValueError(f"need a bf16 CPU weight with both dimensions multiples of 32, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    return weight.reshape(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias) -> [..., N] bf16, with W packed by pack_weight."""
    k, n = packed.shape[1] * 32, packed.shape[0] * 32
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a bf16 weight of {k} input features")
    b = None if bias is None else bias.float().contiguous()
    y = extension().amx_linear(x.reshape(-1, k), packed, b)
    return y.view(*x.shape[:-1], n)


def reference(x, weight, bias=None):
    return F.linear(x, weight, bias)
