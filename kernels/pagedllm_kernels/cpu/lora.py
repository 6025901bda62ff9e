"""Batched LoRA delta on bf16 CPU tensors (the C++ in lora.cpp): launcher and torch reference.

Token rows come in groups, one per adapter slot: `tokens` lists the rows of group g at
[group_start[g], group_start[g + 1]), and group g uses slot `group_slot[g]`. For each such row t:

    y[t] += (x[t] @ a[slot].T) @ b[slot]        a [slots, R, in], b [slots, R, out], R = slices x max_rank

b is block-diagonal by slices: slice i's rank rows [i * max_rank, i * max_rank + slot_rank[slot]) feed the output
columns [slice_offsets[i], slice_offsets[i + 1]); the kernel reads nothing else. Rows in no group are untouched.
"""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import extension


def lora_delta_(y, x, a, b, tokens, group_start, group_slot, slot_rank, slice_offsets, max_rank: int) -> torch.Tensor:
    """In place on y (returned)."""
    extension().lora_delta_(y, x, a, b, tokens, group_start, group_slot, slot_rank, slice_offsets, max_rank)
    return y


def reference_lora_delta_(y, x, a, b, tokens, group_start, group_slot, slot_rank, slice_offsets,
                          max_rank: int) -> torch.Tensor:
    starts, offs = group_start.tolist(), slice_offsets.tolist()
    for g, slot in enumerate(group_slot.tolist()):
        rows = tokens[starts[g]:starts[g + 1]]
        if len(rows) == 0:
            continue
        r = int(slot_rank[slot])
        delta = torch.zeros(len(rows), y.shape[1])
        for i in range(len(offs) - 1):
            lo = i * max_rank
            s = x[rows].float() @ a[slot, lo:lo + r].float().t()
            delta[:, offs[i]:offs[i + 1]] = s @ b[slot, lo:lo + r, offs[i]:offs[i + 1]].float()
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y
