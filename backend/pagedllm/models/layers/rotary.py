"""Rotary position embedding (the HF "rotate half" layout) with the HF configs' rope scaling types, over the first
partial_rotary_factor of each head (the rest passes through), as transformers does."""

from __future__ import annotations

import torch
from torch import nn

# Types whose frequencies transformers switches per forward pass once a sequence passes the original context
# (dynamic NTK, LongRoPE's long factors): up to it they are fixed, so a precomputed table is exact there, and
# the engine's max_model_len stops there (original_context).
SWITCHING_TYPES = {"dynamic", "longrope"}


def rope_type(config) -> str:
    params = dict(getattr(config, "rope_parameters", None) or {})
    return params.get("rope_type", params.get("type", "default"))


def original_context(config) -> int | None:
    """For the switching rope types, the context up to which their frequencies are fixed; None otherwise."""
    if rope_type(config) not in SWITCHING_TYPES:
        return None
    params = dict(getattr(config, "rope_parameters", None) or {})
    return (params.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)


def rope_frequencies(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for config's rope_parameters (those of `layer_type`
    where they are given per layer type, as Gemma 3's are)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: default, "
                                  f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    # seq_len None: the frequencies within the original context (the switching types' short / unscaled ones)
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_frequencies(config, head_dim, layer_type)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)  # [max_pos, D/2]
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions: [T, 1, D/2] each. Done once per step, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused=None) -> torch.Tensor:
    """Rotated x; with the fused ops (layers.fused) x itself is rotated in place (callers use only the result)."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary: the first `rot` of each head
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    if fused is not None and x.shape[-1] % 32 == 0:
        return fused.rotary_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
