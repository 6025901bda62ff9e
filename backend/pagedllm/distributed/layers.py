"""Sharded layers. Each holds only its rank's part of the weight and reads only that part of the checkpoint
tensor (`load_weight` gets a lazy safetensors slice).

Column-parallel: output features split, no communication (the next row-parallel layer consumes the shard).
Row-parallel: input features split, one all-reduce of the output.
Vocabulary-parallel embedding: each rank looks up its vocabulary range, zeros the rest, one all-reduce.
Vocabulary-parallel LM head: each rank scores its range, one all-gather of the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.comm import TensorParallelGroup


def _empty(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """Output rows are the concatenation of this rank's rows of each checkpoint shard (q, k, v or gate, up).
    `shard_rows[i] = (start, size)` is where rank's rows sit in shard i's full tensor."""

    def __init__(self, in_features: int, shard_rows: list[tuple[int, int]], bias: bool) -> None:
        super().__init__()
        self.shard_rows = list(shard_rows)
        self.output_sizes = [size for _, size in shard_rows]  # the loader expects one tensor per shard
        self.weight = _empty(sum(self.output_sizes), in_features)
        self.bias = _empty(sum(self.output_sizes)) if bias else None

    def load_weight(self, param: nn.Parameter, shard: int, ckpt) -> None:
        start, size = self.shard_rows[shard]
        at = sum(self.output_sizes[:shard])
        param.data[at:at + size].copy_(ckpt[start:start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Columns [start, start + size) of the full weight; the partial products are summed across ranks, then the
    bias (whole on every rank) is added once."""

    def __init__(self, in_start: int, in_size: int, out_features: int, group: TensorParallelGroup,
                 bias: bool = False) -> None:
        super().__init__()
        self.group = group
        self.in_start = in_start
        self.weight = _empty(out_features, in_size)
        self.bias = _empty(out_features) if bias else None

    def load_weight(self, param: nn.Parameter, shard, ckpt) -> None:
        if param is self.bias:
            param.data.copy_(ckpt[:])
        else:
            param.data.copy_(ckpt[:, self.in_start:self.in_start + param.shape[1]])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product (a LoRA delta joins it before the reduction: models/lora/layers.py)."""
        return F.linear(x, self.weight)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.local(x))


class VocabRange:
    """Rank's rows of a vocabulary padded to a multiple of the world size: [start, start + per_rank), of
    which `valid` exist in the checkpoint (the last rank may hold padding rows, which stay zero)."""

    def __init__(self, vocab_size: int, rank: int, world_size: int) -> None:
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // world_size)
        self.start = rank * self.per_rank
        self.valid = max(0, min(vocab_size - self.start, self.per_rank))

    def load(self, param: nn.Parameter, ckpt) -> None:
        param.data.zero_()
        param.data[:self.valid].copy_(ckpt[self.start:self.start + self.valid])


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: VocabRange, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab = vocab
        self.weight = _empty(vocab.per_rank, hidden_size)

    def load_weight(self, param: nn.Parameter, shard, ckpt) -> None:
        self.vocab.load(param, ckpt)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.valid)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """Scores this rank's vocabulary range; all ranks get the full logits (rank 0 samples from them)."""

    def __init__(self, vocab: VocabRange, hidden_size: int, tied_weight: nn.Parameter | None,
                 group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab = vocab
        self.weight = tied_weight if tied_weight is not None else _empty(vocab.per_rank, hidden_size)

    def load_weight(self, param: nn.Parameter, shard, ckpt) -> None:
        self.vocab.load(param, ckpt)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., :self.vocab.vocab_size]
