"""fp8 (e4m3) weights for bf16 on AVX512-BF16 CPUs, which have no fp8 arithmetic (the C++ in
quantized_linear.cpp): the weight stays in fp8 (fp8_layout.py) and is widened to bf16 pairs inside the matmul
by table lookups, each column's scale applied to its sum."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import cpu_supported, extension
from pagedllm_kernels.fp8_layout import dequantize

__all__ = ["cpu_supported", "linear", "round_input", "reference", "reference_round_input"]


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """x [rows, K] bf16 -> [rows, N] bf16; bias float32 [N] or None."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] * 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {packed.shape[1] * 2} inputs")
    if x.stride(1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    return extension().fp8_linear(x, packed, scales, bias)


def round_input(x: torch.Tensor, static_scale: float | None = None, per_token: bool = False) -> torch.Tensor:
    """bf16 x [rows, K] (K a multiple of 32) rounded to e4m3 at the static scale, or at max |x| / 448 per row
    (per_token) or over all of x, and back: one pass, where torch takes about nine ops."""
    return extension().fp8_round_input(x if x.stride(1) == 1 else x.contiguous(), static_scale or 0.0, per_token)


def reference_round_input(x, static_scale=None, per_token=False) -> torch.Tensor:
    xf = x.float()
    if static_scale:
        scale = torch.tensor(static_scale)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax()) / 448
        scale = scale.clamp_min(1e-12)
    return ((xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def reference(x, packed, scales, bias=None) -> torch.Tensor:
    y = x.float() @ dequantize(packed, scales).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
