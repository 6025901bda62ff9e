"""Runs one step's forward pass on one rank: owns the rank's KV tensors, builds the attention metadata from a
StepInputs (made on rank 0, see step_inputs.py) and returns the logits of the rows that asked for them. A pure
decode step replays a CUDA graph where they were captured (decode_graphs.py)."""

from __future__ import annotations

import numpy as np
import torch
from pagedllm_kernels import huge_pages

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.engine.kv_sizing import KVGeometry
from pagedllm.engine.step_inputs import StepInputs


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, backend,
                 device: str = "cpu", lora=None) -> None:
        self.model = model
        self.lora = lora  # the model's LoRAModel (models/lora/layers.py), or None
        self.block_size = block_size
        self.backend = backend
        self.device = device
        geo = KVGeometry.of(model)
        shape = (2, num_blocks, block_size, geo.num_kv_heads, geo.head_dim)
        # Zeros write every page: the whole budget is resident from the start (measured), so memory does not grow
        # as blocks come into use. On the CPU on huge pages: a sequence's blocks lie anywhere in the pool.
        self.kv_caches = [huge_pages.zeros(shape, dtype, device) for _ in range(geo.num_layers)]
        self.graphs = None  # DecodeGraphs (engine/decode_graphs.py): pure decode steps replayed per bucket

    @torch.inference_mode()
    def execute_step(self, step: StepInputs) -> torch.Tensor:
        dev = self.device
        if step.block_copies:
            self.copy_blocks(step.block_copies)
        if self.lora is not None:
            self.set_lora(step)
        bucket = self.graphs.bucket(step) if self.graphs is not None else None
        if bucket is not None:
            return self.graphs.run(step, bucket)
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
            rope_lengths=self._rope_lengths(step),
        )
        ids, positions = torch.from_numpy(step.input_ids).to(dev), torch.from_numpy(step.positions).to(dev)
        if hasattr(self.model, "forward_with_logits"):  # the transformers fallback: its own forward picks the rows
            return self.model.forward_with_logits(ids, positions, self.kv_caches, meta, step.logits_indices)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if not step.logits_indices:
            return torch.empty(0)
        # Every rank computes the logits: with a vocabulary-parallel LM head that is a collective.
        return self.model.compute_logits(hidden[torch.tensor(step.logits_indices, device=dev)])

    def _rope_lengths(self, step: StepInputs) -> torch.Tensor | None:
        """Each token's rope length, max(its prompt's length, position + 1), for a model whose rope needs it."""
        if not getattr(self.model, "length_dependent_rope", False) or step.row_prompt_lens is None:
            return None
        prompts = np.repeat(np.asarray(step.row_prompt_lens, dtype=np.int64), np.diff(step.query_start_loc))
        return torch.from_numpy(np.maximum(prompts, step.positions + 1)).to(self.device)

    def set_lora(self, step: StepInputs) -> None:
        """Load the adapters this step brings into their slots, then give each token and logit row its slot."""
        for slot, lora_id, adapter in step.lora_loads:
            self.lora.activate(slot, lora_id, adapter)
        if step.row_lora_slots is None:
            self.lora.set_step(None, None, self.device)
            return
        tokens = np.repeat(np.asarray(step.row_lora_slots, dtype=np.int64), np.diff(step.query_start_loc))
        self.lora.set_step(tokens, tokens[step.logits_indices], self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (K and V, every layer) src -> dst. All sources are read before any destination is
        written, so the pairs see the cache as the previous step left it (a backend's layout inside a block
        moves with it)."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]
