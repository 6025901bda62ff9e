"""One step's flat token batch, in plain arrays that can be pickled to other tensor-parallel ranks.

`build_step_inputs` lays out rows (one per sequence: the tokens it computes this step, where they start, its
block table, how many logits it needs back); `prepare_step` makes those rows from a SchedulerOutput. The draft
model of speculative decoding builds its own rows for its own sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.lora_slots import LoRASlots
from pagedllm.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class StepInputs:
    """Rows are ordered decodes first, shortest context first (the attention backends group neighbouring
    lengths)."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_table: np.ndarray  # [num_rows, max_blocks] int64, padded with the null block 0
    seq_lens: list[int]
    query_start_loc: list[int]  # [num_rows + 1]
    num_decodes: int
    logits_indices: list[int]  # token positions whose logits are returned, in order
    # Copy-on-write of forked sequences' shared blocks, (src, dst) block ids: applied before the forward pass
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # LoRA: each row's adapter slot (-1: the base model) in layout order, None when no row has one; and the
    # adapters to put in their slots first, (slot, adapter id, its LoRAAdapter: the weights travel to every rank)
    row_lora_slots: list[int] | None = None
    lora_loads: list[tuple[int, int, object]] = field(default_factory=list)
    row_prompt_lens: list[int] | None = None  # each row's rope-length floor, in layout order (rope lengths)


@dataclass
class StepRow:
    token_ids: list[int]  # computed this step: known tokens, then any draft tokens
    start: int  # position of the first
    block_ids: list[int]  # the sequence's blocks, covering start + len(token_ids) tokens
    num_logits: int  # logit rows wanted, for the row's last tokens: 0, 1 (it samples), or 1 + k drafts
    lora_slot: int = -1  # the adapter slot its tokens use (-1: the base model)
    prompt_len: int = 0  # its tokens' rope-length floor: the prompt's length (LongRoPE's long regime: the sequence's)


def build_step_inputs(rows: list[StepRow], block_size: int) -> tuple[StepInputs, list[int]]:
    """The step's inputs, and the order its rows were laid out in (indices into `rows`): logits come back for
    the rows with num_logits > 0, in that order."""
    # Decodes first, shortest context first.
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i].token_ids) != 1,
                                                    rows[i].start if len(rows[i].token_ids) == 1 else 0))
    # Decode rows (one token each, the common case) as Python scalars; longer rows as arrays after them.
    decode_ids, decode_pos, decode_slots = [], [], []
    input_ids, positions, slots, seq_lens, starts, picks = [], [], [], [], [0], []
    tables = []
    for i in order:
        row = rows[i]
        n = len(row.token_ids)
        end = row.start + n
        if n == 1:
            decode_ids.append(row.token_ids[0])
            decode_pos.append(row.start)
            decode_slots.append(row.block_ids[row.start // block_size] * block_size + row.start % block_size)
        else:
            blocks = np.asarray(row.block_ids, dtype=np.int64)
            pos = np.arange(row.start, end, dtype=np.int64)
            input_ids.append(np.asarray(row.token_ids, dtype=np.int64))
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        tables.append(row.block_ids)
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        picks.extend(range(starts[-1] - row.num_logits, starts[-1]))
    input_ids.insert(0, np.asarray(decode_ids, dtype=np.int64))
    positions.insert(0, np.asarray(decode_pos, dtype=np.int64))
    slots.insert(0, np.asarray(decode_slots, dtype=np.int64))
    table = np.zeros((len(rows), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    step = StepInputs(np.concatenate(input_ids), np.concatenate(positions), np.concatenate(slots), table,
                      seq_lens, starts, len(decode_ids), picks)
    if any(row.lora_slot >= 0 for row in rows):
        step.row_lora_slots = [rows[i].lora_slot for i in order]
    if any(row.prompt_len for row in rows):
        step.row_prompt_lens = [rows[i].prompt_len for i in order]
    return step, order


@dataclass
class PromptLogits:
    """The logit rows of prompt positions (a request that wants prompt logprobs) in a step's logits."""

    rows: list[tuple[ScheduledRequest, int, int, int]]  # (entry, first logit row, first position, count)
    keep: list[int]  # the logit rows that sample (or verify), in order: the rest are prompt rows


def prepare_step(out: SchedulerOutput, kv: KVCacheManager, block_size: int,
                 lora_slots: LoRASlots | None = None) -> tuple[StepInputs, list[ScheduledRequest], PromptLogits | None]:
    """The step's inputs for the scheduled requests, the entries the sampling logits belong to, in order (one
    logit row per entry that samples, or 1 + k rows for an entry carrying k draft tokens: the positions that
    verify them), and, when some entry wants prompt logprobs, where its prompt positions' logit rows are (they
    come first in its rows: every position of its chunk returns logits). With `lora_slots`, the step's adapters
    are placed in slots first."""
    rows, prompt_counts = [], []
    loads = lora_slots.place([s.request for s in out.scheduled]) if lora_slots is not None else []
    for s in out.scheduled:
        req = s.request
        begin = req.num_computed_tokens
        known = req.all_token_ids[begin:begin + s.num_tokens - len(s.spec_tokens)]
        sampling = 1 + len(s.spec_tokens) if s.samples else 0
        # Position p's logits give prompt token p + 1's logprob: positions up to the prompt's last but one.
        prompt = max(0, min(begin + len(known), req.num_prompt_tokens - 1) - begin) if req.needs_prompt_logits else 0
        prompt_counts.append(prompt)
        rows.append(StepRow(known + s.spec_tokens if s.spec_tokens else known, begin,
                            kv.block_ids(req.request_id), prompt + sampling,
                            lora_slots.slot(req.lora) if lora_slots is not None else -1,
                            req.num_tokens if req.long_rope else req.num_prompt_tokens))
    step, order = build_step_inputs(rows, block_size)
    step.block_copies = kv.take_block_copies()
    step.lora_loads = loads
    sampling_rows = [out.scheduled[i] for i in order if rows[i].num_logits > prompt_counts[i]]
    if not any(prompt_counts):
        return step, sampling_rows, None
    found, keep, at = [], [], 0
    for i in order:
        n, c = rows[i].num_logits, prompt_counts[i]
        if c:
            found.append((out.scheduled[i], at, rows[i].start, c))
        keep.extend(range(at + c, at + n))
        at += n
    return step, sampling_rows, PromptLogits(found, keep)
