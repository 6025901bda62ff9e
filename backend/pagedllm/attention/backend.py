"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.kv_quant import UNIT_SCALES, KVScales
from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """A backend owns the arrangement of elements inside each cache block (the cache's shape is the engine's):
    only its own `store_kv` writes the cache and only its own `forward` reads it."""

    name: str

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 scales: KVScales = UNIT_SCALES) -> None:
        """Writes k, v [T, KVH, D] into their slots (block * block_size + offset; -1 = padding, skipped); into
        an fp8 cache as k / scales.k and v / scales.v (kv_quant.py)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None,
                softcap: float | None = None, kv_scales: KVScales = UNIT_SCALES) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for this step's tokens; kv_cache: [2, num_blocks, block_size, KVH, D]
        of q's dtype or float8_e4m3fn (then every token, this step's too, is attended as the cache holds it).
        Stores k/v at meta.slot_mapping, then returns causal attention over each row's whole context: [T, H, D].
        `softcap`: scores become tanh(score / softcap) * softcap before the softmax (Gemma 2); only the torch
        backend has it (the selector picks it for such models)."""
        ...
