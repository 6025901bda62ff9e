"""The Llama decoder, which Mistral, Qwen2 and Qwen3 specialise by a few switches (see their files).

Inputs are one flat batch of tokens (no padding); attention goes through the paged KV cache via the step's
AttentionMetadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.kv_quant import UNIT_SCALES
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.layers.fused import fused_for
from pagedllm.models.layers.linear import MergedLinear
from pagedllm.models.layers.norm import RMSNorm
from pagedllm.models.layers.rotary import RotaryEmbedding, apply_rotary, max_positions


class Attention(nn.Module):
    fused_ops = None  # set by use_fused_ops (rotary in place)

    def __init__(self, config, qkv_bias: bool, qk_norm: bool, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = sliding_window
        self.softcap: float | None = None  # attention-logit soft-capping (Gemma 2)
        self.kv_scales = UNIT_SCALES  # an fp8 cache's per-tensor scales (the loader sets a checkpoint's)
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, rope, x, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        fused = fused_for(self.fused_ops, q)
        q, k = apply_rotary(q, cos, sin, fused), apply_rotary(k, cos, sin, fused)
        o = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.softcap,
                                 self.kv_scales)
        return self.o_proj(o.reshape(t, self.q_size))


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation_name(config) -> str:
    act = getattr(config, "hidden_activation", None) or config.hidden_act  # Gemma's name for it
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return act


class MLP(nn.Module):
    fused_ops = None  # set by use_fused_ops (SiLU-and-mul)

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.act = activation_name(config)
        inter = intermediate_size or config.intermediate_size
        self.inter = inter
        bias = bool(getattr(config, "mlp_bias", False))  # Llama's mlp_bias: all three projections
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        fused = fused_for(self.fused_ops, gate_up) if self.act == "silu" else None
        if fused is not None:
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, mlp: nn.Module, **attn_kwargs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, **attn_kwargs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp  # an MLP, or a mixture of experts (models/moe.py)

    def forward(self, rope, x, residual, kv_cache, meta):
        """x: the previous layer's output (or the embeddings, with residual None), not yet added to the
        residual stream. Returns this layer's output and the residual stream, the same way."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta), residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    decoder_loop = None  # the layers as one C++ call (models/decoder_loop.py), set per runner where it applies

    def __init__(self, config, windows: list[int | None], mlps: list[nn.Module], **attn_kwargs) -> None:
        """`windows`: each layer's sliding window (None: full attention); `mlps`: each layer's feed-forward."""
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, mlp, sliding_window=w, **attn_kwargs)
                                    for w, mlp in zip(windows, mlps))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_positions(config))

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype, meta.rope_lengths)
        if self.decoder_loop is not None and self.decoder_loop.takes(x.shape[0], kv_caches, meta):
            return self.decoder_loop(x, rope, meta)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, cache, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Family switches, overridden by subclasses: qkv bias, q/k RMSNorm, sliding-window attention (on every
    layer, or on those config.layer_types marks "sliding_attention", as transformers does)."""

    # checkpoint projection name -> (our fused parameter, shard index)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.layer_windows(config),
                                  [self.feed_forward(config, i) for i in range(config.num_hidden_layers)],
                                  qkv_bias=self.qkv_bias(config), qk_norm=self.qk_norm(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def feed_forward(config, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block (the MoE families return their experts here)."""
        return MLP(config)

    def checkpoint_name(self, name: str) -> tuple[str, object]:
        """A checkpoint tensor's name -> (our parameter, its shard: None, a fused layer's index, or what the
        layer's load_weight takes)."""
        for ckpt, (ours, shard) in self.packed_modules.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{ours}."), shard
        return name, None

    @staticmethod
    def checkpoint_splits(config) -> dict[str, list[int]]:
        """Checkpoint modules holding several of our fused layer's shards in one tensor (none: q/k/v and
        gate/up come as separate tensors, `packed_modules`)."""
        return {}

    @staticmethod
    def qkv_bias(config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def qk_norm(config) -> bool:
        return False

    @staticmethod
    def sliding_window(config) -> int | None:
        return None

    def layer_windows(self, config) -> list[int | None]:
        window, layers = self.sliding_window(config), config.num_hidden_layers
        types = getattr(config, "layer_types", None)
        if window is None or not types:
            return [window] * layers
        return [window if t == "sliding_attention" else None for t in types]

    @property
    def length_dependent_rope(self) -> bool:
        """The rope's frequencies depend on each token's rope length (dynamic NTK, LongRoPE)."""
        return self.model.rotary.length_dependent

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler converts to fp32 only where a distribution is needed."""
        return self.lm_head(hidden)
