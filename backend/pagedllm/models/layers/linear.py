"""A linear layer that fuses several checkpoint projections (q/k/v, gate/up) into one matmul, and the decoder's
linears that the quantized layers replace."""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """Output rows are the concatenation of `output_sizes` shards, loaded one checkpoint tensor each."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_weight(self, param: nn.Parameter, shard: int, ckpt) -> None:
        """`ckpt`: shard's checkpoint tensor (or a lazy safetensors slice of it)."""
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        tensor = ckpt[:]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}: expected {size} rows, checkpoint has {tensor.shape[0]}")
        param.data[start:start + size].copy_(tensor)


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of every nn.Linear inside the decoder layers: the projections a quantization replaces (the
    lm_head and the embeddings stay as they are, as the formats leave them)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
