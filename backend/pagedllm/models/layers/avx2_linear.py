"""bf16 linear layers on CPUs whose oneDNN has no bf16 matmul: AVX2 without AVX-512 (AMD Zen 2 and 3, Intel
cores before AVX-512 or AVX-NE-CONVERT). There torch's bf16 F.linear ran at ~15 GFLOP/s on 2 cores, against
~110 for fp32, so a bf16 model's prefill was ~7x slower than it had to be. `Avx2Linear` sends every batch
through our AVX2 kernel (pagedllm_kernels/cpu/avx2_linear.py), on the weight rearranged into the kernel's
tiles: the same bf16 bytes, no second copy (a tied LM head keeps the embedding's own). Where the AVX2 build is
missing (no compiler), the layers stay as they are.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm_kernels.cpu.build import avx2_module

logger = logging.getLogger(__name__)


class Avx2Linear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.register_buffer("weight_tiles", kernel.pack(linear.weight))
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float()  # added before rounding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        return self.kernel.linear(rows, self.weight_tiles, self.bias_f32).view(*x.shape[:-1], self.out_features)


def use_avx2_linears(model: nn.Module, targets: list[tuple[str, nn.Linear]]) -> int:
    """Replace each (name, bf16 CPU nn.Linear) of `targets` in `model` whose shape the kernel takes by an
    Avx2Linear. Returns how many were replaced (0 without the kernel)."""
    kernel = avx2_module("avx2_linear") if targets else None
    if kernel is None:
        return 0
    replaced = 0
    for name, linear in targets:
        if kernel.can_pack(linear.weight):
            model.set_submodule(name, Avx2Linear(linear, kernel))
            replaced += 1
    logger.info("bf16 linears: %d of %d on the AVX2 kernel (oneDNN has no bf16 matmul on this CPU)", replaced,
                len(targets))
    return replaced
