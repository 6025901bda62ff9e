"""Rotary position embedding (the HF "rotate half" layout) with the HF configs' rope scaling types."""

from __future__ import annotations

import torch
from torch import nn

# Types whose frequencies depend on the current sequence length; not supported by a precomputed table.
_DYNAMIC_TYPES = {"dynamic", "longrope"}


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for config's rope_parameters."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type in _DYNAMIC_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: default, linear, "
                                  "llama3, yarn)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_frequencies(config, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)  # [max_pos, D/2]
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions: [T, 1, D/2] each. Done once per step, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused=None) -> torch.Tensor:
    """Rotated x; with the fused ops (layers.fused) x itself is rotated in place (callers use only the result)."""
    if fused is not None and x.shape[-1] % 32 == 0:
        return fused.rotary_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
