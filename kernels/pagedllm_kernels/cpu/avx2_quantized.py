"""Quantized weight linears on CPUs with AVX2 but no AVX-512 (avx2/int4_linear.cpp, avx2/fp8_linear.cpp), on the
layouts every CPU kernel reads (int4_layout.py, fp8_layout.py), so a layer keeps one copy whichever CPU loads it.
Each also has a `*_dequantize_tiles`: the weight as avx2_linear.py's bf16 tiles, for larger batches to run the
bf16 kernel on (one pass over the weight per call). And an fp8 checkpoint's activation rounding, in one pass."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import avx2_extension, avx2_supported

__all__ = ["avx2_supported", "int4_linear", "int4_dequantize_tiles", "fp8_linear", "fp8_dequantize_tiles",
           "fp8_round_input"]


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {in_features} inputs")
    return x


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] bf16 -> [rows, N] bf16; bias float32 [N] or None."""
    return avx2_extension().int4_linear(_rows(x, packed.shape[1] * 2), packed, scales, mins, group_size, bias)


def int4_dequantize_tiles(packed, scales, mins, group_size: int, out: torch.Tensor) -> torch.Tensor:
    """The weight into out, bf16 [N/8, K, 8] (avx2_linear.py's tiles, rounded to bf16)."""
    avx2_extension().int4_dequantize_tiles(packed, scales, mins, group_size, out)
    return out


def fp8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] bf16 -> [rows, N] bf16; scales float32, one per column (any shape); bias float32 [N] or None."""
    return avx2_extension().fp8_linear(_rows(x, packed.shape[1] * 2), packed, scales.reshape(-1), bias)


def fp8_dequantize_tiles(packed, scales, out: torch.Tensor) -> torch.Tensor:
    """The weight (element * its column's scale) into out, bf16 [N/8, K, 8] (avx2_linear.py's tiles)."""
    avx2_extension().fp8_dequantize_tiles(packed, scales.reshape(-1), out)
    return out


def fp8_round_input(x: torch.Tensor, static_scale: float | None = None, per_token: bool = False) -> torch.Tensor:
    """x bf16 [rows, K] (K a multiple of 8) rounded to e4m3 and back, at static_scale, or at max |x| / 448 over
    each row (per_token) or over all of x: one pass, where torch takes about nine ops (fp8_linear.round_input's
    AVX2 twin)."""
    return avx2_extension().fp8_round_input(x if x.stride(1) == 1 else x.contiguous(), static_scale or 0.0, per_token)
