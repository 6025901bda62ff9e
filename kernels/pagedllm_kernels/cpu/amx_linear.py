"""bf16 linear layers with AMX tiles (the C++ in amx_linear.cpp): the weight packed once into tile order, a
launcher that checks shapes, and the torch reference (`F.linear`).

Up to MAX_ROWS rows (decodes) a layer is bound by streaming its weight, and the kernel streams it at 17-21 GB/s
where oneDNN's packed path reached 14-15. Larger batches (prefill chunks) are compute-bound and oneDNN is
faster there (the kernel measured 1.3-1.4x slower on 2,048-row chunks): `linear` unpacks the weight into a
reused buffer (one pass over it, ~5% of such a layer's time) and calls `F.linear`, so the model keeps one
copy of each weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm_kernels.cpu.build import amx_supported, extension
from pagedllm_kernels.cpu.weight_buffer import WeightBuffer

__all__ = ["MAX_ROWS", "WeightBuffer", "amx_supported", "can_pack", "pack_weight", "unpack_weight", "linear",
           "reference"]

MAX_ROWS = 128


def can_pack(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == 0 and k % 32 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32, K/32, 2, 16, 16, 2]: per pair of 16-column panels and 32-wide K step, two B tiles whose
    row r holds the elements k = 2r, 2r + 1 of the panel's 16 columns side by side."""
    if not can_pack(weight):
        raise ValueError(f"need a bf16 CPU weight with both dimensions multiples of 32, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    return weight.reshape(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def unpack_weight(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The plain [N, K] weight back from pack_weight's output (into `out` when given)."""
    n, k = packed.shape[0] * 32, packed.shape[1] * 32
    out = torch.empty(n, k, dtype=packed.dtype) if out is None else out
    extension().amx_unpack_weight(packed, out)
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           buffer: WeightBuffer | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias, fp32: added before rounding, as oneDNN does) -> [..., N] bf16, with W
    packed by pack_weight. Above MAX_ROWS rows the weight is unpacked into `buffer` (a fresh one if None)."""
    k, n = packed.shape[1] * 32, packed.shape[0] * 32
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a bf16 weight of {k} input features")
    rows = x.reshape(-1, k)
    if rows.shape[0] <= MAX_ROWS:
        return extension().amx_linear(rows, packed, bias).view(*x.shape[:-1], n)
    weight = unpack_weight(packed, (buffer or WeightBuffer()).view(n, k))
    # The bias came from bf16, so converting it back is exact; oneDNN adds it before its one rounding.
    return F.linear(rows, weight, None if bias is None else bias.to(torch.bfloat16)).view(*x.shape[:-1], n)


def reference(x, weight, bias=None):
    return F.linear(x, weight, bias)
