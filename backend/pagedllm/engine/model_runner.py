"""One step on the model, in two halves.

`prepare_step` (rank 0 only, where the scheduler lives) turns a SchedulerOutput into a StepInputs: plain
arrays that can be pickled to other tensor-parallel ranks. `ModelRunner.execute_step` (every rank) owns the
KV tensors, builds the attention metadata from the StepInputs and returns the logits of the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.scheduler import ScheduledRequest, SchedulerOutput


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


@dataclass
class StepInputs:
    """One step's flat token batch. Rows are ordered decodes first, shortest context first."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_table: np.ndarray  # [num_rows, max_blocks] int64, padded with the null block 0
    seq_lens: list[int]
    query_start_loc: list[int]  # [num_rows + 1]
    num_decodes: int
    logits_indices: list[int]  # token positions whose logits are returned, in order


def prepare_step(out: SchedulerOutput, kv: KVCacheManager,
                 block_size: int) -> tuple[StepInputs, list[ScheduledRequest]]:
    """Returns the step's inputs and the scheduled entries the logits will belong to, in order: one logit row
    per sampling entry, or 1 + k rows for an entry carrying k draft tokens (the positions that verify them)."""
    # Decodes first, shortest context first (the attention backend groups neighbouring lengths).
    rows = sorted(out.scheduled, key=lambda s: (s.num_tokens != 1, s.request.num_computed_tokens
                                                if s.num_tokens == 1 else 0))
    # Decode rows (one token each, the common case) as Python scalars; longer rows as arrays after them.
    decode_ids, decode_pos, decode_slots = [], [], []
    input_ids, positions, slots, tables, seq_lens, starts = [], [], [], [], [], [0]
    for s in rows:
        req = s.request
        begin, end = req.num_computed_tokens, req.num_computed_tokens + s.num_tokens
        block_ids = kv.block_ids(req.request_id)
        if s.num_tokens == 1:
            decode_ids.append(req.all_token_ids[begin])
            decode_pos.append(begin)
            decode_slots.append(block_ids[begin // block_size] * block_size + begin % block_size)
        else:
            blocks = np.asarray(block_ids, dtype=np.int64)
            pos = np.arange(begin, end, dtype=np.int64)
            known = req.all_token_ids[begin:end - len(s.spec_tokens)]
            input_ids.append(np.asarray(known + s.spec_tokens, dtype=np.int64))
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        tables.append(block_ids)
        seq_lens.append(end)
        starts.append(starts[-1] + s.num_tokens)
    input_ids.insert(0, np.asarray(decode_ids, dtype=np.int64))
    positions.insert(0, np.asarray(decode_pos, dtype=np.int64))
    slots.insert(0, np.asarray(decode_slots, dtype=np.int64))
    table = np.zeros((len(rows), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    sampling = [i for i, s in enumerate(rows) if s.samples]
    picks = [p for i in sampling for p in range(starts[i + 1] - 1 - len(rows[i].spec_tokens), starts[i + 1])]
    step = StepInputs(np.concatenate(input_ids), np.concatenate(positions), np.concatenate(slots), table,
                      seq_lens, starts, len(decode_ids), picks)
    return step, [rows[i] for i in sampling]


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, backend,
                 device: str = "cpu") -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.device = device
        geo = KVGeometry.of(model)
        shape = (2, num_blocks, block_size, geo.num_kv_heads, geo.head_dim)
        # torch.zeros maps fresh pages lazily: untouched blocks cost no resident memory on CPU.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geo.num_layers)]

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """prepare_step + execute_step, for a runner that has its scheduler in the same process."""
        step, rows = prepare_step(out, kv, self.block_size)
        return self.execute_step(step), rows

    @torch.inference_mode()
    def execute_step(self, step: StepInputs) -> torch.Tensor:
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(step.slot_mapping).to(dev),
            block_tables=torch.from_numpy(step.block_table).to(dev),
            seq_lens=torch.tensor(step.seq_lens, device=dev),
            query_start_loc=step.query_start_loc,
            query_start_loc_t=torch.tensor(step.query_start_loc, dtype=torch.int32, device=dev),
            max_query_len=max(b - a for a, b in zip(step.query_start_loc, step.query_start_loc[1:])),
            seq_lens_list=step.seq_lens,
            num_decodes=step.num_decodes,
            block_size=self.block_size,
            backend=self.backend,
        )
        hidden = self.model(torch.from_numpy(step.input_ids).to(dev), torch.from_numpy(step.positions).to(dev),
                            self.kv_caches, meta)
        if not step.logits_indices:
            return torch.empty(0)
        # Every rank computes the logits: with a vocabulary-parallel LM head that is a collective.
        return self.model.compute_logits(hidden[torch.tensor(step.logits_indices, device=dev)])
