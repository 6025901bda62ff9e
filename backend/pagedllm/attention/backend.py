"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for this step's tokens; kv_cache: [2, num_blocks, block_size, KVH, D].
        Stores k/v at meta.slot_mapping, then returns causal attention over each row's whole context: [T, H, D]."""
        ...
