"""Gemma 2 and Gemma 3 (text): the Llama attention and MLP with Gemma's own wiring.

- RMSNorm scales by (1 + weight), in fp32 throughout (GemmaRMSNorm); Gemma 3 adds per-head q/k norms of
  that kind.
- Four norms per layer: before and after attention, before and after the MLP (the residual adds come after the
  post-norms).
- Embeddings scaled by sqrt(hidden_size), the factor rounded to the model's dtype as transformers does.
- Sliding-window and full-attention layers as config.layer_types says; Gemma 3 gives each kind its own rope
  parameters.
- Attention scale query_pre_attn_scalar ** -0.5; gelu (tanh) MLP; final logits soft-capped when
  final_logit_softcapping is set; Gemma 2's attention scores soft-capped (attn_logit_softcapping), which only
  the torch attention backend does (the selector picks it).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.llama import MLP, Attention, LlamaForCausalLM
from pagedllm.models.layers.rotary import RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, qkv_bias=bool(config.attention_bias), qk_norm=False,
                                   sliding_window=sliding_window)
        if qk_norm:
            self.self_attn.q_norm = GemmaRMSNorm(self.self_attn.head_dim, eps)
            self.self_attn.k_norm = GemmaRMSNorm(self.self_attn.head_dim, eps)
        self.self_attn.scale = config.query_pre_attn_scalar ** -0.5
        self.self_attn.softcap = getattr(config, "attn_logit_softcapping", None)
        self.mlp = MLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, rope, x, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config, qk_norm: bool, rope_per_layer_type: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        self.layer_types = list(config.layer_types)
        window = config.sliding_window
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, window if t == "sliding_attention" else None, qk_norm)
                                    for t in self.layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        kinds = sorted(set(self.layer_types))
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(config, config.head_dim, config.max_position_embeddings,
                                                        t if rope_per_layer_type else None) for t in kinds})

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ropes = {t: rotary.lookup(positions, x.dtype) for t, rotary in self.rotary.items()}
        for layer, kind, cache in zip(self.layers, self.layer_types, kv_caches):
            x = layer(ropes[kind], x, cache, meta)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm_layers, rope_per_layer_type = True, True
    length_dependent_rope = False  # its rope types are fixed ones (default, linear)

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = GemmaModel(config, self.qk_norm_layers, self.rope_per_layer_type)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """No q/k norms, one set of rope parameters, soft-capped attention scores."""

    qk_norm_layers, rope_per_layer_type = False, False
