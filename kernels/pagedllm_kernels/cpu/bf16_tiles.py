"""A dense bf16 weight for decode-sized batches on AVX512-BF16 CPUs (the C++ in quantized_linear.cpp): the
weight in fp8_layout.py's arrangement, two bytes an element (per tile of 16 output columns and pair of input
rows, each column's two elements side by side), streamed once per 8 rows of x, several tiles side by side so
each broadcast of x feeds several pair dot products. On the 2-core AMD host, the 125M model's 49 linears with
the weights streamed from memory (one process, alternated with oneDNN's packed matmul; perf/bf16_linear.py):
1.47-1.89x oneDNN at 1-2 rows, 1.31-1.56x at 4-12, 1.04-1.24x at 16-64, 1.04-1.4x at 96-256 (oneDNN pads 65-128
rows to 128), 1.05-1.26x at 257-300 (a step oneDNN takes just above 256), 1.0-1.08x at 512, 0.99-1.06x at 1,024,
0.92-1.0x at 2,048, so callers use it up to MAX_ROWS. End to end, a 264-token prompt's prefill took 1.28-1.30x a
250-token one's with oneDNN above 256 rows and 1.04-1.07x with our kernel up to 512 (125M, one process each).
On the 2-core Zen 5 host (full-width AVX-512) it was 1.3-1.4x oneDNN at 1-2 rows, 1.07-1.25x at 4-8, but 0.85-0.94x
at 16-64, until its weight streams were prefetched from 5 rows up (quantized_linear.cpp): the load-time race
then gave it 1.18 / 1.15 / 1.08 / 1.05 / 1.01 / 1.02x oneDNN at 16 / 32 / 64 / 128 / 256 / 512 rows (125M
shapes; 0.5B's: ours up to 128 rows). PackedLinear races the two at load
(backend/pagedllm/models/layers/linear_race.py)."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import cpu_supported, extension
from pagedllm_kernels.fp8_layout import TILE, arrange, unarrange

__all__ = ["MAX_ROWS", "PREFETCH_SWITCH", "can_pack", "cpu_supported", "linear", "pack", "reference"]

MAX_ROWS = 512  # above this, oneDNN's packed matmul is as fast or faster (measured, Zen 4); the race's ceiling
PREFETCH_SWITCH = True  # `linear`'s software prefetch, which the load-time race turns on or off per host


def can_pack(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % TILE == 0 and k % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (N a multiple of 16, K even) -> [N/16, K/2, 16, 2]."""
    if not can_pack(weight):
        raise ValueError(f"a bf16 weight with N % 16 == 0 and even K, not {weight.dtype} {tuple(weight.shape)}")
    return arrange(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           prefetch: bool = True) -> torch.Tensor:
    """x [rows, K] bf16 -> [rows, N] bf16; bias float32 [N] or None. `prefetch`: from 5 rows, request each weight
    stream ahead in software (faster on Zen 5; the load-time race decides per host, linear_race.py)."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] * 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {packed.shape[1] * 2} inputs")
    if x.stride(1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    return extension().bf16_linear(x, packed, bias, prefetch)


def reference(x, packed, bias=None) -> torch.Tensor:
    y = x.float() @ unarrange(packed).float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
