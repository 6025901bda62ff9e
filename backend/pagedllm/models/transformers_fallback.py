"""The generic fallback for a `*ForCausalLM` the registry does not know: transformers' own model class computes
everything except attention, which goes through our paged backends. The model is loaded with
`attn_implementation="pagedllm"`, an attention function registered with transformers' AttentionInterface (and
a mask function that builds no mask: ours is the block tables), so every layer's attention call stores its
K/V in the paged cache and attends through it. Paging, continuous batching, prefix caching, preemption and
metrics all work as for the native families.

A step's flat token batch goes in as one sequence ([1, tokens]) with our positions (so rotary is right per
token) and no transformers cache. Logits come from the model's own forward with `logits_to_keep` set to the
rows that need them, so family-specific output steps (soft-capping, logit scales) are kept.

Slower than the native families (no fused ops, packed linears or LoRA; no tensor parallelism); engines using
it log that they do.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import torch
from torch import nn

logger = logging.getLogger(__name__)

ATTENTION = "pagedllm"
_step = threading.local()  # the step's kv_caches and metadata, for the attention function


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [1, heads, tokens, dim], key/value [1, kv_heads, ...]
    -> ([1, tokens, heads, dim], None)."""
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention-logit soft-capping is not supported by the paged backends")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    meta = _step.meta
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = meta.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), _step.kv_caches[module.layer_idx],
                               meta, scale, window)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _paged_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


class TransformersForCausalLM(nn.Module):
    """Built from the config alone; transformers' model is made once, by `load_pretrained` from the checkpoint.
    Exposes what the engine reads of a model: `model.layers[i].self_attn` (heads, KV heads, head_dim, window)
    and `config`."""

    is_fallback = True
    packed_modules: dict = {}

    def __init__(self, config) -> None:
        super().__init__()
        import transformers

        register_attention()
        self.config = config
        self.hf_class = getattr(transformers, config.architectures[0])
        self.device = torch.get_default_device()  # build_model's torch.device context: where to load
        self.hf: nn.Module | None = None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        windows = self._windows(config)
        # what the engine reads of a model (KV sizing, the attention race); not modules
        object.__setattr__(self, "model", SimpleNamespace(layers=[
            SimpleNamespace(self_attn=SimpleNamespace(num_heads=config.num_attention_heads, num_kv_heads=kv_heads,
                                                      head_dim=head_dim, sliding_window=w)) for w in windows]))
        logger.warning("%s is not a native pagedllm architecture: running transformers' model class with paged "
                       "attention (the fallback: slower, no fused ops, LoRA or tensor parallelism)",
                       config.architectures[0])

    @staticmethod
    def _windows(config) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if window is None or getattr(config, "use_sliding_window", True) is False:
            return [None] * config.num_hidden_layers
        if types:
            return [window if t == "sliding_attention" else None for t in types]
        return [window] * config.num_hidden_layers

    def load_pretrained(self, model_dir: str, dtype: torch.dtype) -> None:
        """transformers' own loading (its checkpoint conversions included)."""
        self.hf = self.hf_class.from_pretrained(model_dir, dtype=dtype, attn_implementation=ATTENTION)
        self.hf.to(self.device).eval()

    def forward_with_logits(self, input_ids, positions, kv_caches, meta, logits_indices) -> torch.Tensor:
        _step.kv_caches, _step.meta = kv_caches, meta
        try:
            # (0 would mean every row: with none wanted, one is computed and dropped)
            keep = torch.as_tensor(logits_indices, device=input_ids.device) if logits_indices else 1
            out = self.hf(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                          logits_to_keep=keep)
        finally:
            _step.kv_caches = _step.meta = None
        return out.logits[0] if logits_indices else torch.empty(0)
