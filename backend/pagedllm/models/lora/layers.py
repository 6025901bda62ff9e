"""Batched multi-LoRA on a built model: each target module keeps its base layer and adds, for every token, the
delta of the adapter in that token's slot. One step can mix any adapters resident in the `max_loras` slots and
the base model (slot -1).

    y = base(x) + (x @ A[slot]^T) @ B[slot]        A: [slots, R, in], B: [slots, R, out], scaling in B

A fused module (qkv, gate/up) holds its projections' ranks side by side: A's R = projections x max_lora_rank
columns, B block-diagonal, so one shrink and one expand serve all of them. Ranks below the maximum and
projections an adapter leaves out are zeros.

The delta is computed per adapter group of tokens, never per request or per layer in Python (the groups are
built once per step, `LoRABatch`):
- CPU, bf16: our C++ kernel (kernels/cpu/lora.cpp), shrink and expand fused per block of a group's tokens,
  straight into y's rows; 2.1x faster than the torch path over a 125M decode step (perf/lora.py --deltas).
- CPU otherwise (fp32, or no AVX512-BF16): the tokens gathered into one group per active slot (padded to the
  largest group, pads zeroed), two `bmm`s, one `index_add_` back.
- GPU: our Triton SGMV kernel over segments of consecutive tokens sharing a slot (kernels/lora_sgmv.py).

An adapter's own full embedding or LM head (adapter.py) replaces the model's for its rows: its embedding rows
are looked up in its table, its logit rows are scored by its head (one matmul per such adapter in the step).

Tensor parallelism: a column-parallel module's B keeps this rank's output rows (A whole); a row-parallel
one's A keeps this rank's input columns (B whole), and its delta is added to the partial product before the
all-reduce (the sum over ranks of B (A_r x_r) is B A x). The embedding's and LM head's deltas are computed
whole on every rank, after the vocabulary-parallel layer has combined its result.
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.lora.adapter import LoRAAdapter

_LAYER_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.\w+\.(\w+)$")


class LoRABatch:
    """Which slot each row of a step's activations uses (-1: the base model), in the shapes the kernels take."""

    def __init__(self, slots: np.ndarray, device, dtype: torch.dtype, sgmv: bool | None = None) -> None:
        """`sgmv`: take the Triton SGMV path (default: on a GPU; tests run it on the CPU under the interpreter)."""
        self.num_rows = len(slots)
        self.active = sorted(set(slots[slots >= 0].tolist()))
        if not self.active:
            return
        dev = torch.device(device)
        self.slots = torch.from_numpy(slots).to(dev)
        self.row_slots = torch.from_numpy(np.maximum(slots, 0)).to(dev)  # base rows: any slot, never grouped
        self.sgmv = dev.type == "cuda" if sgmv is None else sgmv
        if self.sgmv:
            # runs of consecutive rows with one slot
            edges = np.flatnonzero(np.diff(slots)) + 1
            starts = np.concatenate([[0], edges])
            lens = np.diff(np.concatenate([starts, [len(slots)]]))
            keep = slots[starts] >= 0
            self.seg_start = torch.from_numpy(starts[keep]).to(dev)
            self.seg_len = torch.from_numpy(lens[keep]).to(dev)
            self.seg_slot = torch.from_numpy(slots[starts][keep]).to(dev)
            self.max_seg_len = int(lens[keep].max())
            return
        groups = [np.flatnonzero(slots == s) for s in self.active]
        # the C++ kernel's form: the groups' rows one after another, where each group starts, its slot
        self.tokens = torch.from_numpy(np.concatenate(groups))
        self.group_start = torch.tensor([0] + np.cumsum([len(g) for g in groups]).tolist())
        self.group_slot = torch.tensor(self.active)
        width = max(len(g) for g in groups)
        index = np.zeros((len(groups), width), dtype=np.int64)
        mask = np.zeros((len(groups), width, 1), dtype=np.float32)
        for j, g in enumerate(groups):
            index[j, :len(g)], mask[j, :len(g)] = g, 1.0
        # The slots' weights: a view when the active slots are 0..k-1 (the usual case), else gathered per use.
        k = len(self.active)
        self.slot_ids = None if self.active == list(range(k)) else torch.tensor(self.active, device=dev)
        self.index = torch.from_numpy(index.reshape(-1)).to(dev)  # pads point at row 0, and add zero there
        # None when every group is full (no pads to zero)
        self.mask = None if all(len(g) == width for g in groups) else torch.from_numpy(mask).to(dev, dtype)
        self.width = width

    def weights(self, w: torch.Tensor) -> torch.Tensor:
        """The active slots' rows of a [slots, ...] stack, in group order."""
        return w[:len(self.active)] if self.slot_ids is None else w.index_select(0, self.slot_ids)

    def grouped(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [groups, width, K]: each active slot's rows, pads repeating row 0."""
        return rows.index_select(0, self.index).view(len(self.active), self.width, rows.shape[1])

    def touches(self, slots) -> bool:
        return any(s in slots for s in self.active)

    def replace_rows(self, y: torch.Tensor, full: dict[int, torch.Tensor], compute) -> None:
        """For each active slot with its own table in `full`: y[its rows] = compute(rows, table)."""
        for slot in self.active:
            if slot in full:
                rows = torch.nonzero(self.slots == slot).flatten()
                y[rows] = compute(rows, full[slot])

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, module: LoRALinear) -> torch.Tensor:
        """y += (x @ a[slot]^T) @ b[slot] for every row with a slot (a, b: the module's stacks); returns y."""
        a, b = module.lora_a, module.lora_b
        if self.sgmv:
            from pagedllm_kernels.lora_sgmv import sgmv

            at = a.transpose(1, 2)
            s = x.new_zeros(x.shape[0], a.shape[1])
            sgmv(x, at, s, self.seg_start, self.seg_len, self.seg_slot, self.max_seg_len, accumulate=False)
            return sgmv(s, b, y, self.seg_start, self.seg_len, self.seg_slot, self.max_seg_len, accumulate=True)
        if module.kernel is not None and x.dtype == torch.bfloat16 and y.stride(-1) == 1 and x.stride(-1) == 1:
            return module.kernel.lora_delta_(y, x, a, b, self.tokens, self.group_start, self.group_slot,
                                             module.slot_rank, module.slice_offsets, module.max_rank)
        return self.add_expanded(y, torch.bmm(self.grouped(x), self.weights(a).transpose(1, 2)), b)

    def add_expanded(self, y: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """CPU: y += s @ b[slot], s grouped [groups, width, R] (its pads are zeroed here)."""
        if self.mask is not None:
            s.mul_(self.mask)
        d = torch.bmm(s, self.weights(b))
        return y.index_add_(0, self.index, d.view(-1, d.shape[2]))


class LoRAState:
    """The step's batches, shared by every LoRA module of a model: one for the token rows of the forward pass,
    one for the rows compute_logits scores. None: no row uses an adapter (the modules add nothing)."""

    def __init__(self) -> None:
        self.tokens: LoRABatch | None = None
        self.logits: LoRABatch | None = None


def _clear_slot(module, slot: int, full: torch.Tensor | None) -> None:
    """Empty `slot` of a module's stacks and record there the adapter's own full weight (or none)."""
    module.full.pop(slot, None)
    if full is not None:
        module.full[slot] = full.to(module.lora_b.dtype)
    module.lora_a[slot].zero_()
    module.lora_b[slot].zero_()


class LoRALinear(nn.Module):
    """`slices`: (checkpoint projection, first row in its full tensor, rows) in the order of the base layer's
    output rows; `in_range`: (first column, columns) of the full input this rank holds."""

    def __init__(self, base: nn.Module, slices: list[tuple[str, int, int]], in_range: tuple[int, int],
                 state: LoRAState, max_loras: int, max_rank: int, rows: str = "tokens", kernel=None) -> None:
        super().__init__()
        self.base = base
        self.slices, self.in_range = slices, in_range
        self.state, self.rows, self.max_rank = state, rows, max_rank
        self.kernel = kernel  # pagedllm_kernels.cpu.lora, or None (torch ops)
        self.slice_offsets = torch.tensor([0] + np.cumsum([n for _, _, n in slices]).tolist())
        self.slot_rank = torch.zeros(max_loras, dtype=torch.long)  # the largest rank of the slot's slices
        weight = next(base.parameters(), None)
        dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.get_default_dtype()
        device = weight.device if weight is not None else "cpu"
        ranks = len(slices) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, ranks, in_range[1], dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, ranks, sum(n for _, _, n in slices), dtype=dtype,
                                                   device=device))
        self.loaded: set[int] = set()  # slots whose adapter has weights for this module
        self.full: dict[int, torch.Tensor] = {}  # slot -> the adapter's own weight (the LM head only)

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None],
                 full: torch.Tensor | None = None) -> None:
        """Slot `slot` takes one (A [r, in], B [out, r]) pair per slice (None: that projection is left out) and,
        for the LM head, the adapter's own full weight if it has one."""
        _clear_slot(self, slot, full)
        col, (first, width), out = 0, self.in_range, 0
        for (_, start, size), pair in zip(self.slices, pairs):
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                self.lora_a[slot, col:col + r] = a[:, first:first + width]
                self.lora_b[slot, col:col + r, out:out + size] = b[start:start + size].t()
            col += self.max_rank
            out += size
        self.slot_rank[slot] = max((p[0].shape[0] for p in pairs if p is not None), default=0)
        if any(p is not None for p in pairs):
            self.loaded.add(slot)
        else:
            self.loaded.discard(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = getattr(self.state, self.rows)
        local = getattr(self.base, "local", None)  # row-parallel: the delta joins before the all-reduce
        y = local(x) if local is not None else self.base(x)
        if batch is not None and self.full and batch.touches(self.full):
            batch.replace_rows(y, self.full, lambda rows, w: F.linear(x[rows], w))
        if batch is not None and batch.touches(self.loaded):
            y = batch.add_delta(y, x, self)
        return self.base.reduce(y) if local is not None else y


class LoRAEmbedding(nn.Module):
    """The embedding's delta: A's columns are looked up by token id (no shrink matmul), then expanded."""

    def __init__(self, base: nn.Module, vocab_size: int, hidden_size: int, state: LoRAState, max_loras: int,
                 max_rank: int) -> None:
        super().__init__()
        self.base, self.state = base, state
        weight = base.weight
        self.register_buffer("lora_a", torch.zeros(max_loras, vocab_size, max_rank, dtype=weight.dtype,
                                                   device=weight.device))
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, hidden_size, dtype=weight.dtype,
                                                   device=weight.device))
        self.loaded: set[int] = set()
        self.full: dict[int, torch.Tensor] = {}  # slot -> the adapter's own embedding table

    def set_slot(self, slot: int, pair, full: torch.Tensor | None = None) -> None:
        _clear_slot(self, slot, full)
        if pair is None:
            self.loaded.discard(slot)
            return
        a, b = pair  # [r, vocab], [hidden, r]
        r = a.shape[0]
        self.lora_a[slot, :, :r] = a.t()
        self.lora_b[slot, :r] = b.t()
        self.loaded.add(slot)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        batch = self.state.tokens
        if batch is not None and self.full and batch.touches(self.full):
            batch.replace_rows(y, self.full, lambda rows, table: F.embedding(ids[rows], table))
        if batch is None or not batch.touches(self.loaded):
            return y
        s = self.lora_a[batch.row_slots, ids]  # [T, R]
        if batch.sgmv:
            from pagedllm_kernels.lora_sgmv import sgmv

            return sgmv(s, self.lora_b, y, batch.seg_start, batch.seg_len, batch.seg_slot, batch.max_seg_len,
                        accumulate=True)
        return batch.add_expanded(y, batch.grouped(s), self.lora_b)


class LoRAModel:
    """A model's adapter slots: construction wraps its target modules; `activate` copies an adapter's weights
    (this rank's split of them) into a slot; `set_step` tells the modules which rows use which slot."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, kernel=None) -> None:
        self.model, self.config, self.kernel = model, model.config, kernel
        self.max_loras, self.max_rank = max_loras, max_rank
        self.state = LoRAState()
        self.linears: dict[int, list[LoRALinear]] = {}  # layer -> its wrapped projections
        self.slot_ids: list[int | None] = [None] * max_loras  # adapter id in each slot
        self._install()

    def _install(self) -> None:
        fused = {}  # our module -> its checkpoint projections, in output order
        for proj, (ours, index) in self.model.packed_modules.items():
            fused.setdefault(ours, {})[index] = proj
        fused = {ours: [p[i] for i in sorted(p)] for ours, p in fused.items()}
        fused.update(o_proj=["o_proj"], down_proj=["down_proj"])
        modules = dict(self.model.named_modules())
        for name, module in list(modules.items()):
            m = _LAYER_MODULE.search(name)
            if m is None or m.group(2) not in fused:
                continue
            projections = fused[m.group(2)]
            if hasattr(module, "shard_rows"):  # column-parallel: this rank's rows of each projection
                slices = [(p, start, size) for p, (start, size) in zip(projections, module.shard_rows)]
            else:
                sizes = getattr(module, "output_sizes", [module.weight.shape[0]])
                slices = [(p, 0, size) for p, size in zip(projections, sizes)]
            in_start = getattr(module, "in_start", 0)  # row-parallel: this rank's input columns
            wrapped = LoRALinear(module, slices, (in_start, module.weight.shape[1]), self.state, self.max_loras,
                                 self.max_rank, kernel=self.kernel)
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, wrapped)
            self.linears.setdefault(int(m.group(1)), []).append(wrapped)
        inner = self.model.model
        self.embed = LoRAEmbedding(inner.embed_tokens, self.config.vocab_size, self.config.hidden_size,
                                   self.state, self.max_loras, self.max_rank)
        inner.embed_tokens = self.embed
        self.lm_head = LoRALinear(self.model.lm_head, [("lm_head", 0, self.config.vocab_size)],
                                  (0, self.config.hidden_size), self.state, self.max_loras, self.max_rank,
                                  rows="logits", kernel=self.kernel)
        self.model.lm_head = self.lm_head

    @torch.inference_mode()
    def activate(self, slot: int, lora_id: int, adapter: LoRAAdapter) -> None:
        """Put adapter `lora_id` (its weights, checked against the model) in `slot`, evicting whatever was there."""
        for layer, modules in self.linears.items():
            for module in modules:
                module.set_slot(slot, [adapter.projections.get((layer, p)) for p, _, _ in module.slices])
        self.embed.set_slot(slot, adapter.embed_tokens, adapter.full.get("embed_tokens"))
        self.lm_head.set_slot(slot, [adapter.lm_head], adapter.full.get("lm_head"))
        self.slot_ids[slot] = lora_id

    def set_step(self, token_slots: np.ndarray | None, logit_slots: np.ndarray | None, device) -> None:
        """Rows' slots for the next forward pass and its logits (None, or all -1: no adapter this step)."""
        dtype = self.embed.lora_a.dtype
        self.state.tokens = _batch(token_slots, device, dtype)
        self.state.logits = _batch(logit_slots, device, dtype)


def _batch(slots: np.ndarray | None, device, dtype: torch.dtype) -> LoRABatch | None:
    if slots is None or not (slots >= 0).any():
        return None
    return LoRABatch(slots, device, dtype)
