"""How many KV blocks a memory budget holds for a model: the bytes one block of one rank's KV costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGeometry:
    """What one rank's KV cache holds per token: layers x KV heads (this rank's share) x head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model) -> KVGeometry:
        attn = model.model.layers[0].self_attn  # after sharding: this rank's heads
        return cls(len(model.model.layers), attn.num_kv_heads, attn.head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks(self, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        """Blocks the budget holds, the null block included."""
        return budget_bytes // self.bytes_per_block(block_size, dtype)


def check_room_for_one_request(num_blocks: int, budget_bytes: int, block_size: int, max_model_len: int) -> None:
    """Raise ValueError unless one request of max_model_len tokens fits (plus the null block)."""
    needed = cdiv(max_model_len, block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"kv_cache_memory_bytes: {budget_bytes} bytes hold {num_blocks} blocks; one request of "
            f"max_model_len={max_model_len} needs {needed}. Raise the budget or lower max_model_len.")
