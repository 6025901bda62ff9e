"""What the engine needs to know about its model, resolved once from the HF config and the engine config:
dtype, device, context length, EOS ids, vocabulary size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.models.checkpoint import eos_token_ids, load_config
from pagedllm.models.layers.rotary import max_positions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    hf_config: object
    dtype: torch.dtype
    device: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    kv_dtype: torch.dtype  # the KV cache's elements: the model's dtype, or float8_e4m3fn

    @classmethod
    def resolve(cls, config: EngineConfig, tokenizer) -> ModelInfo:
        hf = load_config(config.model)
        device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _resolve_dtype(config.dtype, hf, device)
        kv_dtype = dtype if config.cache.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        return cls(hf, dtype, device, _resolve_max_model_len(config, hf),
                   frozenset(eos_token_ids(config.model, hf, tokenizer)), hf.vocab_size, kv_dtype)

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]


def _resolve_dtype(name: str, hf_config, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = _DTYPES.get(dt, torch.float32)
    # float16 on CPU is slow and overflow-prone: auto picks bfloat16 there instead (a GPU keeps float16).
    if dt == torch.float16 and not device.startswith("cuda"):
        return torch.bfloat16
    return dt or torch.float32


def _resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    limit = max_positions(hf_config)
    asked = config.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len: {asked} exceeds the model's context {limit} (max_position_embeddings"
                         f"{', times its dynamic rope factor' if limit != hf_config.max_position_embeddings else ''})")
    return asked or limit

