"""The fp8 KV cache's elements: e4m3 (float8_e4m3fn) with one scale per layer's K and one per its V.

A cached value is round(x / scale) clamped to e4m3's range (±448, so nothing becomes NaN); it reads back as
fp8 * scale. Every backend attends over these read-back values, also for a prompt's own fresh K/V (which a
backend may take from the step rather than the cache), so that the backends agree with each other and a token
means the same whether its K/V came from this step or from an earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class KVScales:
    """A layer's per-tensor scales (1.0 unless the checkpoint has its own, as in vLLM)."""

    k: float = 1.0
    v: float = 1.0


UNIT_SCALES = KVScales()


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x -> e4m3 elements of x / scale (round to nearest even, clamped to ±448)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x8: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    out = x8.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What the cache will give back for x."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's storage as uint8, for the copy and index ops torch lacks for float8 on CPU."""
    return t.view(torch.uint8)
