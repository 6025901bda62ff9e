"""Runs one scheduled step on the model: builds the flat token batch and attention metadata, owns the KV
tensors, and returns the logits of the rows that sample."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.scheduler import ScheduledRequest, SchedulerOutput


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * block_size * hf_config.num_key_value_heads * head_dim * elem


class ModelRunner:
    def __init__(self, model, hf_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 backend, device: str = "cpu") -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.device = device
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        shape = (2, num_blocks, block_size, hf_config.num_key_value_heads, head_dim)
        # torch.zeros maps fresh pages lazily: untouched blocks cost no resident memory on CPU.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(hf_config.num_hidden_layers)]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """Returns (logits, the scheduled entries they belong to, in order): one logit row per sampling entry,
        or 1 + k rows for an entry carrying k draft tokens (the positions that verify them)."""
        # Decodes first, shortest context first (the attention backend groups neighbouring lengths).
        rows = sorted(out.scheduled, key=lambda s: (s.num_tokens != 1, s.request.num_computed_tokens
                                                    if s.num_tokens == 1 else 0))
        input_ids, positions, slots, tables, seq_lens, starts = [], [], [], [], [], [0]
        bs = self.block_size
        for s in rows:
            req = s.request
            begin, end = req.num_computed_tokens, req.num_computed_tokens + s.num_tokens
            block_ids = np.asarray(kv.block_ids(req.request_id), dtype=np.int64)
            pos = np.arange(begin, end, dtype=np.int64)
            known = req.all_token_ids[begin:end - len(s.spec_tokens)]
            input_ids.append(np.asarray(known + s.spec_tokens, dtype=np.int64))
            positions.append(pos)
            slots.append(block_ids[pos // bs] * bs + pos % bs)
            tables.append(block_ids)
            seq_lens.append(end)
            starts.append(starts[-1] + s.num_tokens)
        max_blocks = max(len(t) for t in tables)
        table = np.zeros((len(rows), max_blocks), dtype=np.int64)  # padded with the null block
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(table).to(dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            query_start_loc=starts,
            query_start_loc_t=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_tokens for s in rows),
            seq_lens_list=seq_lens,
            num_decodes=sum(1 for s in rows if s.num_tokens == 1),
            block_size=bs,
            backend=self.backend,
        )
        hidden = self.model(torch.from_numpy(np.concatenate(input_ids)).to(dev),
                            torch.from_numpy(np.concatenate(positions)).to(dev), self.kv_caches, meta)
        sampling = [i for i, s in enumerate(rows) if s.samples]
        if not sampling:
            return torch.empty(0), []
        picks = [p for i in sampling for p in range(starts[i + 1] - 1 - len(rows[i].spec_tokens), starts[i + 1])]
        return self.model.compute_logits(hidden[torch.tensor(picks, device=dev)]), [rows[i] for i in sampling]
