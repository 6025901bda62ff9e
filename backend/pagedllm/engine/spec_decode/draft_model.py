"""Draft-model proposer: a smaller model sharing the target's tokenizer proposes k tokens per request.

The draft keeps its own paged KV (its own block pool and runner, sized by `kv_cache_memory_bytes` in the
speculative config) and, per target request, a DraftSequence: the tokens the draft has seen and how many of
them have valid draft KV. Each step the sequence is re-synchronised with the target's tokens: draft KV stays
valid for the longest common prefix (accepted drafts are reused, rejected ones are recomputed over), then the
draft catches up in one pass and runs k-1 more single-token passes, all requests batched together, through the
runner's public entry point (StepInputs). Greedy requests take the draft's argmax; sampled ones draw from the
draft's processed distribution, which the verifier needs as q.
"""

from __future__ import annotations

import torch

from pagedllm.attention.torch_backend import TorchAttention
from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.engine.executor.worker import WorkerSpec, load_shard
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.kv_sizing import KVGeometry
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.request import Request
from pagedllm.engine.sampler import target_probs
from pagedllm.engine.spec_decode.proposer import Draft
from pagedllm.engine.step_inputs import StepRow, build_step_inputs
from pagedllm.models.checkpoint import load_config


class DraftSequence:
    """The draft model's copy of one target request (what KVCacheManager allocates for)."""

    __slots__ = ("generator", "num_computed_tokens", "request_id", "token_ids")

    def __init__(self, request_id: str, token_ids: list[int], generator: torch.Generator) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_computed_tokens = 0  # leading tokens whose draft KV is valid
        self.generator = generator


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, info: ModelInfo) -> None:
        hf = load_config(spec.model)
        if hf.vocab_size != info.vocab_size:
            raise ValueError(f"speculative_config: the draft's vocabulary ({hf.vocab_size}) differs from the "
                             f"target's ({info.vocab_size})")
        self.k = spec.num_speculative_tokens
        self.block_size = block_size = config.cache.block_size
        model = load_shard(WorkerSpec(spec.model, info.dtype, info.device, block_size, config.fused_cpu_ops,
                                      config.amx_linear), hf, info.device)
        budget = spec.kv_cache_memory_bytes or config.cache.kv_cache_memory_bytes // 4
        num_blocks = KVGeometry.of(model).num_blocks(budget, block_size, info.dtype)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.runner = ModelRunner(model, num_blocks, block_size, info.dtype, TorchAttention(), info.device)
        self.max_positions = hf.max_position_embeddings
        self.sequences: dict[str, DraftSequence] = {}

    def drop(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        live = []  # (sequence, sampling params, most tokens to draft)
        for req, limit in wanted:
            limit = min(limit, self.k, self.max_positions - req.num_tokens)
            if limit > 0:
                live.append((self._sync(req), req.sampling_params, limit))
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq, _, _ in live}
        probs: dict[str, list[torch.Tensor]] = {seq.request_id: [] for seq, _, _ in live}
        for step in range(max((limit for _, _, limit in live), default=0)):
            rows, batch = [], []
            for seq, params, limit in live:
                n = len(seq.token_ids) - seq.num_computed_tokens
                if step >= limit or not self.kv.allocate_slots(seq, n):  # a full draft pool: no draft for it
                    continue
                rows.append(StepRow(seq.token_ids[seq.num_computed_tokens:], seq.num_computed_tokens,
                                    self.kv.block_ids(seq.request_id), 1))
                batch.append((seq, params))
            if not rows:
                break
            step_inputs, order = build_step_inputs(rows, self.block_size)
            logits = self.runner.execute_step(step_inputs)
            for row, i in enumerate(order):
                seq, params = batch[i]
                if params.greedy:
                    token = int(logits[row].argmax())
                else:
                    q = target_probs(logits[row:row + 1].float().cpu(), params)[0]
                    token = int(torch.multinomial(q, 1, generator=seq.generator))
                    probs[seq.request_id].append(q)
                seq.num_computed_tokens = len(seq.token_ids)
                seq.token_ids.append(token)
                drafts[seq.request_id].append(token)
        return {rid: Draft(toks, torch.stack(probs[rid]) if probs[rid] else None)
                for rid, toks in drafts.items() if toks}

    def _sync(self, req: Request) -> DraftSequence:
        """The request's draft sequence, its tokens made the target's; draft KV kept for their common prefix."""
        seq = self.sequences.get(req.request_id)
        target = req.all_token_ids
        if seq is None:
            # Draws for sampled drafts come from a generator of their own, so the draft never shifts the
            # target's random stream.
            seed = req.sampling_params.seed
            seq = DraftSequence(req.request_id, list(target),
                                torch.Generator().manual_seed(seed if seed is not None else 0))
            self.sequences[req.request_id] = seq
            return seq
        mine = seq.token_ids
        common = 0
        limit = min(len(target), len(mine), seq.num_computed_tokens)
        while common < limit and target[common] == mine[common]:
            common += 1
        seq.token_ids = list(target)
        seq.num_computed_tokens = min(common, len(target) - 1)
        return seq
