"""bf16 linear layers with AMX tiles (the C++ in amx_linear.cpp): the weight packed once into tile order, a
launcher that checks shapes, and the torch reference (`F.linear`).

On AMX hosts this is PackedLinear's kernel for decode-sized batches, in the place bf16_tiles.py takes elsewhere
(the same interface: MAX_ROWS, can_pack, pack, linear), and oneDNN's packed matmul takes the batches above the
row count a race at load gives ours (backend/pagedllm/models/layers/linear_race.py). On the 2-core Intel AMX
host (Xeon, 2026-12-05), the 0.5B shape's 96 decoder linears streamed from memory: 33.4 / 41.5 / 61.9 / 104.9 ms
at 1 / 64 / 128 / 256 rows, oneDNN's packed matmul 34.7 / 47.4 / 65.9 / 89.6 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm_kernels.cpu.build import amx_supported, extension

__all__ = ["MAX_ROWS", "PREFETCH_SWITCH", "amx_supported", "can_pack", "pack", "linear", "reference"]

# The race's ceiling: above, oneDNN's packed matmul. The 125M model's 48 decoder linears streamed (the engine's
# malloc setting, Intel AMX host, 2026-12-06): ours 2.15-2.34 TFLOP/s at 512-2,048 rows; oneDNN 1.5-1.6 up to
# 1,024 rows (ours 1.33 / 1.55x at 512 / 1,024) and 2.4 from 1,536 (ours 0.91-0.94x).
MAX_ROWS = 1024
PREFETCH_SWITCH = False  # the kernel prefetches its weight on each pass itself: nothing for the race to switch


def can_pack(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == 0 and k % 32 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32, K/32, 2, 16, 16, 2]: per pair of 16-column panels and 32-wide K step, two B tiles whose
    row r holds the elements k = 2r, 2r + 1 of the panel's 16 columns side by side."""
    if not can_pack(weight):
        raise ValueError(f"need a bf16 CPU weight with both dimensions multiples of 32, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    return weight.detach().reshape(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           prefetch: bool = True) -> torch.Tensor:
    """x [rows, K] bf16 @ W^T (+ bias, fp32: added before rounding, as oneDNN does) -> [rows, N] bf16, with W
    packed by `pack`. `prefetch` is bf16_tiles.linear's switch, which this kernel does not have (ignored)."""
    k = packed.shape[1] * 32
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a bf16 weight of {k} input features")
    return extension().amx_linear(x, packed, bias)


def reference(x, weight, bias=None):
    return F.linear(x, weight, bias)
