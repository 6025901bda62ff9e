"""Weight-only int4 linear for bf16 on AVX512-BF16 CPUs (the C++ in quantized_linear.cpp): the weight stays packed
(int4_layout.py) and is dequantized inside the matmul, 16 columns x 2 input rows per pair dot product. Large
batches are compute-bound, where oneDNN's bf16 matmul wins: `dequantize_into` writes the plain weight into a
reused buffer for them (one pass over it per call, not a second copy of the model).
"""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import cpu_supported, extension
from pagedllm_kernels.int4_layout import dequantize

__all__ = ["cpu_supported", "linear", "dequantize_into", "reference"]


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] bf16 -> [rows, N] bf16; bias float32 [N] or None."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] * 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {packed.shape[1] * 2} inputs")
    if x.stride(1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    return extension().int4_linear(x, packed, scales, mins, group_size, bias)


def dequantize_into(packed, scales, mins, group_size: int, out: torch.Tensor) -> torch.Tensor:
    extension().int4_dequantize(packed, scales, mins, group_size, out)
    return out


def reference(x, packed, scales, mins, group_size, bias=None) -> torch.Tensor:
    """fp32 math on the dequantized weight, rounded to x's dtype."""
    y = x.float() @ dequantize(packed, scales, mins, group_size).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
