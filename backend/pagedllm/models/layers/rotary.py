"""Rotary position embedding (the HF "rotate half" layout) with the HF configs' rope scaling types, over the first
partial_rotary_factor of each head (the rest passes through), as transformers does."""

from __future__ import annotations

import torch
from torch import nn

# Types whose frequencies depend on the sequence's length once it passes the original context.
# - dynamic NTK grows its base. transformers decides per forward pass from its longest position, which in its own
#   generate() means: a prompt's tokens use the prompt's length, a generated token at position p uses p + 1. The
#   engine reproduces that per token ("rope length" max(prompt length, p + 1), from the step's rows), so chunked
#   prefill, batching and recompute after preemption change nothing; the prefix cache keys a long prompt's blocks
#   by its length (engine.request).
# - LongRoPE switches to its long factors once the sequence passes the original context, and transformers' Phi-3
#   then recomputes the whole sequence with them (its generate() drops the cache at the crossing). The engine does
#   the same: a sequence that passes it is recomputed once (engine.scheduler), and from then on every token of it
#   has a rope length past the original context (its row carries the sequence's length); its blocks are hashed
#   apart from short-factor ones.
SWITCHING_TYPES = {"dynamic", "longrope"}


def max_positions(config) -> int:
    """The longest context the model's rope is defined for: max_position_embeddings, times the factor for dynamic
    NTK (whose point is to stretch it, as vLLM also allows)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if rope_type(config) == "dynamic":
        return int(config.max_position_embeddings * params.get("factor", 1.0))
    return config.max_position_embeddings


def rope_type(config) -> str:
    params = dict(getattr(config, "rope_parameters", None) or {})
    return params.get("rope_type", params.get("type", "default"))


def original_context(config) -> int | None:
    """For the switching rope types, the context up to which their frequencies are fixed; None otherwise."""
    if rope_type(config) not in SWITCHING_TYPES:
        return None
    params = dict(getattr(config, "rope_parameters", None) or {})
    if rope_type(config) == "dynamic":  # transformers measures dynamic NTK from max_position_embeddings
        return config.max_position_embeddings
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
        self.config = config
        self.kind = rope_type(config) if layer_type is None and rope_type(config) in SWITCHING_TYPES else None
        self.original = original_context(config) if self.kind else None
        self._tables("", inv_freq, scaling, max_positions)  # cos, sin: [max_pos, D/2]
        if self.kind == "longrope":  # the long factors, for tokens whose rope length passes the original context
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            long_freq, long_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=self.original + 1)
            self._tables("_long", long_freq.float(), float(long_scaling), max_positions)
        self._dynamic: dict[int, torch.Tensor] = {}  # rope length -> dynamic NTK inverse frequencies

    def _tables(self, suffix: str, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        self.register_buffer("cos" + suffix, freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin" + suffix, freqs.sin() * scaling, persistent=False)

    @property
    def length_dependent(self) -> bool:
        return self.kind is not None

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               rope_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions: [T, 1, D/2] each. Done once per step, shared by all layers.
        `rope_lengths` (the switching types): each token's rope length (see SWITCHING_TYPES)."""
        cos, sin = self.cos[positions], self.sin[positions]
        if self.kind is not None and rope_lengths is not None:
            beyond = rope_lengths > self.original
            if self.kind == "longrope":
                if bool(beyond.any()):
                    cos = torch.where(beyond[:, None], self.cos_long[positions], cos)
                    sin = torch.where(beyond[:, None], self.sin_long[positions], sin)
            elif bool(beyond.any()):
                cos, sin = cos.clone(), sin.clone()
                for length in torch.unique(rope_lengths[beyond]).tolist():
                    rows = torch.nonzero(rope_lengths == length).flatten()
                    freqs = positions[rows].float()[:, None] * self._dynamic_freq(int(length))[None, :]
                    cos[rows], sin[rows] = freqs.cos(), freqs.sin()
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def _dynamic_freq(self, length: int) -> torch.Tensor:
        """transformers' dynamic NTK frequencies for a sequence of `length` (its own computation)."""
        if length not in self._dynamic:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if len(self._dynamic) > 4096:
                self._dynamic.clear()
            inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](self.config, None, seq_len=length)
            self._dynamic[length] = inv_freq.float().to(self.cos.device)
        return self._dynamic[length]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused=None) -> torch.Tensor:
    """Rotated x; with the fused ops (layers.fused) x itself is rotated in place (callers use only the result)."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary: the first `rot` of each head
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    if fused is not None and x.shape[-1] % 32 == 0:
        return fused.rotary_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
