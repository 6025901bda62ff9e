"""The tensor-parallel transform: turns a freshly built (unloaded) model into one rank's shard.

The model definitions know nothing of parallelism; this module rewrites their attention, MLP, embedding and
LM head in place, by module type, before the weights are loaded (each sharded layer then reads only its part
of the checkpoint):

    attention  q heads split evenly; KV heads split evenly, or replicated when ranks outnumber them (rank r
               keeps the KV head its q heads read); qkv column-parallel, o row-parallel (one all-reduce)
    MLP        gate/up column-parallel, down row-parallel (one all-reduce)
    embedding  vocabulary-parallel (one all-reduce); LM head vocabulary-parallel (one all-gather of logits)

Norms and rotary tables are replicated.
"""

from __future__ import annotations

from torch import nn

from pagedllm.distributed.comm import TensorParallelGroup
from pagedllm.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabRange,
)
from pagedllm.models.layers.moe import FusedMoE
from pagedllm.models.llama import MLP, Attention


def kv_heads_for_rank(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first KV head, count) that `rank` holds."""
    if num_kv_heads >= world_size:
        per = num_kv_heads // world_size
        return rank * per, per
    # Fewer KV heads than ranks: each rank's q heads all read one KV head, which it keeps a copy of.
    q_per_rank = num_heads // world_size
    return rank * q_per_rank // (num_heads // num_kv_heads), 1


def check_shardable(hf_config, world_size: int) -> None:
    """Raise ValueError naming what does not divide."""
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    problems = []
    if heads % world_size:
        problems.append(f"num_attention_heads={heads}")
    if kv % world_size and world_size % kv:
        problems.append(f"num_key_value_heads={kv} (must divide or be divided by it)")
    if hf_config.intermediate_size % world_size:
        problems.append(f"intermediate_size={hf_config.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size: {world_size} does not divide {', '.join(problems)}")


def _shard_attention(attn: Attention, hidden: int, group: TensorParallelGroup) -> None:
    rank, world = group.rank, group.world_size
    hd = attn.head_dim
    q_heads = attn.num_heads // world
    kv_start, kv_heads = kv_heads_for_rank(attn.num_heads, attn.num_kv_heads, rank, world)
    q_rows = (rank * q_heads * hd, q_heads * hd)
    kv_rows = (kv_start * hd, kv_heads * hd)
    attn.qkv_proj = ColumnParallelLinear(hidden, [q_rows, kv_rows, kv_rows], bias=attn.qkv_proj.bias is not None)
    attn.o_proj = RowParallelLinear(q_rows[0], q_rows[1], hidden, group)
    attn.num_heads, attn.num_kv_heads = q_heads, kv_heads
    attn.q_size, attn.kv_size = q_heads * hd, kv_heads * hd


def _shard_mlp(mlp: MLP, hidden: int, group: TensorParallelGroup) -> None:
    inter = mlp.inter // group.world_size
    rows = (group.rank * inter, inter)
    bias = mlp.down_proj.bias is not None  # Llama's mlp_bias
    mlp.gate_up_proj = ColumnParallelLinear(hidden, [rows, rows], bias=bias)
    mlp.down_proj = RowParallelLinear(rows[0], inter, hidden, group, bias=bias)
    mlp.inter = inter


def _shard_experts(moe: FusedMoE, hidden: int, group: TensorParallelGroup) -> None:
    if moe.full_inter % group.world_size:
        raise ValueError(f"tensor_parallel_size: {group.world_size} does not divide the experts' intermediate "
                         f"size {moe.full_inter}")
    moe.shard(group.rank, group.world_size, group)


_SHARDERS = {Attention: _shard_attention, MLP: _shard_mlp, FusedMoE: _shard_experts}


def shard_model(model: nn.Module, group: TensorParallelGroup) -> nn.Module:
    """Rewrite `model` (built, weights not loaded) into this rank's shard, its layers communicating over `group`;
    returns it. New parameters are made on torch's current default device (call it under `torch.device(...)`)."""
    config = model.config
    check_shardable(config, group.world_size)
    hidden = config.hidden_size
    for module in list(model.modules()):
        sharder = _SHARDERS.get(type(module))
        if sharder is not None:
            sharder(module, hidden, group)
    vocab = VocabRange(config.vocab_size, group.rank, group.world_size)
    embed = VocabParallelEmbedding(vocab, hidden, group)
    model.model.embed_tokens = embed
    model.lm_head = ParallelLMHead(vocab, hidden, embed.weight if config.tie_word_embeddings else None, group)
    return model
