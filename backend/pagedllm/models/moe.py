"""Mixture-of-experts families over the Llama decoder: each swaps its feed-forward for the fused MoE layer
(models/layers/moe.py) and maps the experts' checkpoint tensors into it.

    Mixtral     every layer; top-k renormalised, fp32 weights; experts' w1 (gate), w3 (up), w2 (down)
    Qwen3-MoE   Qwen3 attention; MoE on the layers decoder_sparse_step and mlp_only_layers say (the others a dense
                MLP); top-k renormalised when norm_topk_prob; experts' gate/up/down_proj
    Qwen2-MoE   Qwen2 attention; likewise, plus a shared expert (a dense MLP) scaled by sigmoid(shared_expert_gate)
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagedllm.models.layers.moe import FusedMoE
from pagedllm.models.llama import ACTIVATIONS, MLP, LlamaForCausalLM, activation_name
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM

# an expert's checkpoint tensor: (layer prefix, expert, projection)
_EXPERT = re.compile(r"^(.*\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER = re.compile(r"^(.*\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
_PARTS = {"w1": ("w_gate_up", 0), "w3": ("w_gate_up", 1), "w2": ("w_down", 0),
          "gate_proj": ("w_gate_up", 0), "up_proj": ("w_gate_up", 1), "down_proj": ("w_down", 0)}


class _MoEMixin:
    """The expert mapping shared by the families (a mixin before their Llama-derived base)."""

    def checkpoint_name(self, name: str) -> tuple[str, object]:
        m = _EXPERT.match(name)
        if m is not None and m.group(3) in _PARTS:
            param, part = _PARTS[m.group(3)]
            return f"{m.group(1)}.mlp.experts.{param}", (int(m.group(2)), part)
        m = _ROUTER.match(name)
        if m is not None:  # Mixtral's router
            return f"{m.group(1)}.mlp.experts.gate.weight", None
        if ".mlp.gate.weight" in name:  # the Qwen MoE routers
            return name.replace(".mlp.gate.weight", ".mlp.experts.gate.weight"), None
        return super().checkpoint_name(name)


class SparseMoeBlock(nn.Module):
    """The experts, and (Qwen2-MoE) a shared expert gated by sigmoid(shared_expert_gate(x))."""

    def __init__(self, experts: FusedMoE, shared: MLP | None = None, hidden: int = 0) -> None:
        super().__init__()
        self.experts = experts
        self.shared_expert = shared
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def _experts(config, num_experts: int, inter: int, renormalize: bool, model_dtype_weights: bool) -> FusedMoE:
    return FusedMoE(config.hidden_size, inter, num_experts, config.num_experts_per_tok, renormalize,
                    model_dtype_weights, ACTIVATIONS[activation_name(config)])


class MixtralForCausalLM(_MoEMixin, LlamaForCausalLM):
    @staticmethod
    def feed_forward(config, layer: int) -> nn.Module:
        return SparseMoeBlock(_experts(config, config.num_local_experts, config.intermediate_size, True, False))

    @staticmethod
    def sliding_window(config):
        return getattr(config, "sliding_window", None)


def _qwen_moe_layer(config, layer: int) -> bool:
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class Qwen3MoeForCausalLM(_MoEMixin, Qwen3ForCausalLM):
    @staticmethod
    def feed_forward(config, layer: int) -> nn.Module:
        if not _qwen_moe_layer(config, layer):
            return MLP(config)
        return SparseMoeBlock(_experts(config, config.num_experts, config.moe_intermediate_size,
                                       config.norm_topk_prob, True))


class Qwen2MoeForCausalLM(_MoEMixin, Qwen2ForCausalLM):
    @staticmethod
    def feed_forward(config, layer: int) -> nn.Module:
        if not _qwen_moe_layer(config, layer):
            return MLP(config)
        experts = _experts(config, config.num_experts, config.moe_intermediate_size, config.norm_topk_prob, True)
        shared = MLP(config, config.shared_expert_intermediate_size) if config.shared_expert_intermediate_size \
            else None
        return SparseMoeBlock(experts, shared, config.hidden_size)
