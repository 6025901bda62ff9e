"""A quantized checkpoint's linears (models/quantization/config.py) swapped in around the weight load:
`replace_quantized_linears` before it (every decoder projection the config quantizes; the lm_head and the
embeddings stay dense, as the formats leave them) and `finish_quantized_linears` after it."""

from __future__ import annotations

from torch import nn

from pagedllm.models.layers.fp8_linear import Fp8Linear
from pagedllm.models.layers.int4_linear import Int4Linear
from pagedllm.models.layers.linear import MergedLinear, decoder_linears
from pagedllm.models.layers.staged_linear import StagedLinear
from pagedllm.models.quantization.config import Fp8Config, Int4Config
from pagedllm_kernels.cpu.weight_buffer import WeightBuffer


def replace_quantized_linears(model: nn.Module, config: Int4Config | Fp8Config) -> int:
    kind = Int4Linear if isinstance(config, Int4Config) else Fp8Linear
    targets = [(n, m) for n, m in decoder_linears(model) if config.quantizes(n)]
    for name, linear in targets:
        sizes = linear.output_sizes if isinstance(linear, MergedLinear) else None
        q = kind(linear.in_features, linear.out_features, sizes, linear.bias is not None, config)
        model.set_submodule(name, q.to(linear.weight.device))
    return len(targets)


def finish_quantized_linears(model: nn.Module) -> None:
    buffer = WeightBuffer()  # one dequantization buffer for all of the model's int4 and fp8 layers
    for module in model.modules():
        if isinstance(module, StagedLinear):
            module.finish(buffer)
