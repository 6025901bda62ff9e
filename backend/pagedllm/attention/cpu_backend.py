"""CPU attention through our AVX-512 paged kernel, which reads K/V in place through the block table.

The cache blocks are arranged for the kernel's dot products (pagedllm_kernels/cpu/kv_layout.py), so this
backend writes them with its own store kernel. One kernel call per layer serves the whole mixed batch: a
decode row is one query token, and a prefill token at position p is treated as a decode row whose context is
its row's first p + 1 tokens (this step's K/V are stored first, so they are there). Measured faster than the
torch backend for decodes and prefills alike (perf/attention_share.py).
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata


class CpuAttention:
    name = "cpu"

    def __init__(self) -> None:
        from pagedllm_kernels.cpu import kv_layout
        from pagedllm_kernels.cpu import paged_decode_attention as kernel

        ok, why = kernel.cpu_supported()
        if not ok:
            raise RuntimeError(why)
        self._kernel, self._layout = kernel, kv_layout

    def warm_up(self, device: str) -> None:
        """Compile (or load the cached build of) the kernel; only for CPU engines, so GPU hosts skip it."""
        if device != "cpu":
            raise RuntimeError(f"a CPU kernel; the engine runs on {device}")
        self._kernel.load_kernel()

    def store_kv(self, k, v, kv_cache, slot_mapping) -> None:
        self._layout.store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None):
        self.store_kv(k, v, kv_cache, meta.slot_mapping)
        rows = meta.backend_cache.get("cpu_rows")
        if rows is None:  # the first layer of the step
            rows = meta.backend_cache["cpu_rows"] = self._token_rows(meta, q.shape[0], q.device)
        tables, lens = rows
        return self._kernel.paged_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, scale,
                                                   sliding_window)

    @staticmethod
    def _token_rows(meta: AttentionMetadata, num_tokens: int, device):
        """Every query token as a kernel row: its row's block table, and its context length (its row's length
        minus the row's tokens after it). The same for every layer of a step."""
        starts = meta.query_start_loc_t.long()
        row_of_token = torch.repeat_interleave(torch.arange(meta.num_rows, device=device), starts.diff())
        after = starts[1:][row_of_token] - 1 - torch.arange(num_tokens, device=device)
        return meta.block_tables[row_of_token], meta.seq_lens[row_of_token] - after
