"""CPU attention through our AVX-512 paged kernel, which reads K/V in place through the block table.

The cache blocks are arranged for the kernel's dot products (pagedllm_kernels/cpu/kv_layout.py), so this
backend writes them with its own store kernel. One kernel call per layer serves the mixed batch: a decode
row is one query token, and a prefill token at position p is treated as a decode row whose context is its
row's first p + 1 tokens (this step's K/V are stored first, so they are there). Whole fresh prompts go to
torch's fused causal SDPA instead (see _StepPlan). Measured faster than the torch backend for decodes and
prefills alike (perf/attention_share.py). An fp8 cache (with a bf16 model) is read by the same kernel, its bytes
widened to bf16 pairs as they load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.kv_quant import UNIT_SCALES, KVScales, is_fp8, round_trip
from pagedllm.attention.metadata import AttentionMetadata


class CpuAttention:
    name = "cpu"

    def __init__(self) -> None:
        from pagedllm_kernels.cpu import kv_layout
        from pagedllm_kernels.cpu import paged_attention as kernel

        ok, why = kernel.cpu_supported()
        if not ok:
            raise RuntimeError(why)
        self._kernel, self._layout = kernel, kv_layout

    def warm_up(self, device: str) -> None:
        """Compile (or load the cached build of) the kernel; only for CPU engines, so GPU hosts skip it."""
        if device != "cpu":
            raise RuntimeError(f"a CPU kernel; the engine runs on {device}")
        self._kernel.load_kernel()

    def store_kv(self, k, v, kv_cache, slot_mapping, scales: KVScales = UNIT_SCALES) -> None:
        self._layout.store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping, scales.k, scales.v)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                softcap: float | None = None, kv_scales: KVScales = UNIT_SCALES):
        if softcap is not None:
            raise NotImplementedError(f"{self.name}: attention-logit soft-capping is not supported")
        if is_fp8(kv_cache) and q.dtype != torch.bfloat16:
            raise NotImplementedError(f"{self.name}: an fp8 KV cache needs a bfloat16 model, not {q.dtype}")
        self.store_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        key = ("cpu_plan", sliding_window)
        plan = meta.backend_cache.get(key)
        if plan is None:  # the first layer of the step
            plan = meta.backend_cache[key] = _StepPlan.of(meta, q.shape[0], sliding_window, q.device)
        def attend(queries):
            return self._kernel.paged_attention(queries, kv_cache[0], kv_cache[1], plan.tables, plan.lens, scale,
                                                sliding_window, kv_scales.k, kv_scales.v)

        if not plan.fresh_rows:
            return attend(q)
        out = torch.empty_like(q)
        if plan.kernel_tokens.numel():
            out[plan.kernel_tokens] = attend(q[plan.kernel_tokens])
        if is_fp8(kv_cache):  # fresh prompts attend to their own K/V as the cache holds them
            k, v = round_trip(k, kv_scales.k), round_trip(v, kv_scales.v)
        for s, e in plan.fresh_rows:
            # [1, heads, tokens, head_dim] views: SDPA takes its fused CPU path only for 4-D inputs.
            qr, kr, vr = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))
            out[s:e] = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale,
                                                      enable_gqa=True)[0].transpose(0, 1)
        return out


@dataclass
class _StepPlan:
    """How a step's tokens are attended, the same in every layer.

    A prompt that starts at position 0 and is whole in this step ("fresh") attends only to its own K/V: torch's
    fused causal SDPA does that from the step's k, v directly, 2.5-4.5x faster than one kernel row per token
    (perf/attention_share.py). Every other token (decodes, chunks after cached tokens, prefix hits, rows longer
    than a sliding window) is a kernel row: its row's block table, and its context length (its row's length
    minus the row's tokens after it)."""

    fresh_rows: list[tuple[int, int]]  # token ranges
    kernel_tokens: torch.Tensor  # indices of the kernel's tokens (all tokens when fresh_rows is empty)
    tables: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata, num_tokens: int, window: int | None, device) -> _StepPlan:
        fresh = []
        for row in range(meta.num_decodes, meta.num_rows):
            n = meta.seq_lens_list[row]
            if meta.query_len(row) == n and (window is None or n <= window):
                fresh.append((meta.query_start_loc[row], meta.query_start_loc[row + 1]))
        starts = meta.query_start_loc_t.long()
        row_of_token = torch.repeat_interleave(torch.arange(meta.num_rows, device=device), starts.diff())
        after = starts[1:][row_of_token] - 1 - torch.arange(num_tokens, device=device)
        kernel_tokens = torch.arange(num_tokens, device=device)
        if fresh:
            fresh_mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
            for s, e in fresh:
                fresh_mask[s:e] = True
            kernel_tokens = kernel_tokens[~fresh_mask]
            row_of_token, after = row_of_token[kernel_tokens], after[kernel_tokens]
        return cls(fresh, kernel_tokens, meta.block_tables[row_of_token], meta.seq_lens[row_of_token] - after)
