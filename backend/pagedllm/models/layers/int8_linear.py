"""`quantization="int8"`: W8A8 on CPU, made at load from a dense checkpoint, as vLLM's CPU backend offers it.
Each decoder projection's weight is quantized once per output column; its input is quantized per token at
each call, inside our AVX512-VNNI kernel (pagedllm_kernels/cpu/int8_linear.py). The lm_head and embeddings
stay as they are."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.layers.linear import decoder_linears


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed, scales, wsum = kernel.quantize_weight(linear.weight.data)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("wsum", wsum)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.float(), requires_grad=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._kernel.linear(x.reshape(-1, self.in_features), self.packed, self.scales, self.wsum, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A8 per channel / per token"


def quantize_to_int8(model: nn.Module) -> int:
    """Replace the decoder's nn.Linear layers (after their weights load) by Int8Linear; returns how many."""
    from pagedllm_kernels.cpu import int8_linear

    ok, why = int8_linear.vnni_supported()
    if not ok:
        raise ValueError(f"quantization='int8' {why} (AVX512-VNNI int8 dot products)")
    targets = decoder_linears(model)
    for name, linear in targets:
        model.set_submodule(name, Int8Linear(linear, int8_linear))
    return len(targets)
