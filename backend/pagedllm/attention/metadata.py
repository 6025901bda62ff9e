"""The per-step attention metadata, built once per step by the model runner and handed to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes one step's flattened token batch.

    Rows (sequences) are ordered decodes first: the first `num_decodes` rows contribute exactly one token each,
    so tokens [0, num_decodes) are decode tokens. Later rows are prefills or prefill chunks of any length.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block_id * block_size + offset) of each new token
    block_tables: torch.Tensor  # [num_rows, max_blocks] int64, padded with the null block 0
    seq_lens: torch.Tensor  # [num_rows] int64: context length including this step's tokens
    query_start_loc: list[int]  # [num_rows + 1] where each row's tokens start in the flat batch
    query_start_loc_t: torch.Tensor  # the same, as an int32 tensor on the device (for kernels)
    max_query_len: int
    seq_lens_list: list[int]
    num_decodes: int
    block_size: int
    backend: AttentionBackend  # noqa: F821 - set by the runner; layers call meta.backend.forward(...)
    # [num_tokens] each token's rope length, for rope types whose frequencies depend on it (models/layers/rotary.py)
    rope_lengths: torch.Tensor | None = None
    # What a backend derives from this metadata once per step and reuses in every layer.
    backend_cache: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_list)

    def query_len(self, row: int) -> int:
        return self.query_start_loc[row + 1] - self.query_start_loc[row]
