"""The part every quantized linear shares: it takes a checkpoint's tensors as they come (one set per fused
shard, through the loader's load_weight) and keeps them until all have arrived, when the subclass's `finish`
builds its kernels' layout from them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm_kernels.cpu.build import avx2_module
from pagedllm_kernels.cpu.weight_buffer import WeightBuffer


class StagedLinear(nn.Module):
    ignores_zero_bias = True  # AutoGPTQ writes zero biases for bias-free projections (models/loader.py)

    def __init__(self, in_features: int, out_features: int, output_sizes: list[int] | None, bias: bool,
                 checkpoint_names: list[str]) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if output_sizes is not None:
            self.output_sizes = list(output_sizes)  # a fused layer: the loader hands it one shard at a time
        for name in checkpoint_names:  # placeholders the loader fills
            self.register_parameter(name, nn.Parameter(torch.empty(0), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._staged: dict[tuple[str, int | None], torch.Tensor] = {}
        self.buffer: WeightBuffer | None = None  # the model's shared dequantization buffer, given to `finish`

    def load_weight(self, param: nn.Parameter, shard: int | None, ckpt) -> None:
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        tensor = ckpt if isinstance(ckpt, torch.Tensor) else ckpt[...]
        self._staged[(name, shard)] = tensor  # a bias too: the model's dtype would round an fp16 one

    def dense(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x through a dequantized copy of the weight (the paths without a kernel), with the bias."""
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def through_avx2_tiles(self, x: torch.Tensor, write_tiles) -> torch.Tensor:
        """x through the AVX2 bf16 kernel (CPUs without AVX-512, larger batches), on the weight that
        write_tiles(out) writes into the shared buffer as that kernel's bf16 tiles [N/8, K, 8], with the bias."""
        tiles = write_tiles(self.buffer.view(self.out_features, self.in_features).view(-1, self.in_features, 8))
        return avx2_module("avx2_linear").linear(x, tiles, self.bias)

    def shard_sizes(self) -> list[tuple[int | None, int]]:
        """(shard, its output rows) for each checkpoint projection this layer holds."""
        if not hasattr(self, "output_sizes"):
            return [(None, self.out_features)]
        return list(enumerate(self.output_sizes))

    def staged(self, shard: int | None) -> dict[str, torch.Tensor]:
        return {name: t for (name, s), t in self._staged.items() if s == shard}

    def take_staged(self) -> torch.device:
        """Drop the placeholders and the staged tensors (call after reading them); returns the layer's device."""
        device = next(p for n, p in self.named_parameters(recurse=False) if n != "bias").device
        for name in [n for n, _ in self.named_parameters(recurse=False) if n != "bias"]:
            delattr(self, name)
        if self.bias is not None:  # fp32, from the checkpoint's own values, shard by shard
            bias = torch.empty(self.out_features)
            start = 0
            for shard, size in self.shard_sizes():
                part = self._staged[("bias", shard)].float().reshape(-1)
                if part.numel() != size:
                    raise ValueError(f"bias of {part.numel()} values for {size} output rows")
                bias[start:start + size] = part
                start += size
            self.bias = nn.Parameter(bias.to(device), requires_grad=False)
        self._staged.clear()
        return device
