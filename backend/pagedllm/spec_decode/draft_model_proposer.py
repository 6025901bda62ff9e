"""Draft-model proposer: a smaller model sharing the target's tokenizer proposes k tokens per request.

The draft keeps its own paged KV (its own block pool and runner, sized by `kv_cache_memory_bytes` in the
speculative config) and, per target request, a shadow Request holding the draft's view of the tokens. Each
step the shadow is re-synchronised with the target's tokens: draft KV stays valid for the longest common
prefix (accepted drafts are reused, rejected ones are recomputed over), then the draft catches up in one
pass and runs k-1 more single-token passes, all requests batched together. Greedy requests take the draft's
argmax; sampled ones draw from the draft's processed distribution, which the verifier needs as q.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

from pagedllm.attention.torch_backend import TorchAttention
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.model_runner import KVGeometry, ModelRunner
from pagedllm.engine.request import Request
from pagedllm.engine.sampler import target_probs
from pagedllm.engine.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.models.loader import load_model


class DraftModelProposer:
    def __init__(self, model_dir: str, k: int, dtype: torch.dtype, device: str, block_size: int,
                 kv_cache_memory_bytes: int, target_vocab_size: int) -> None:
        if k < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be >= 1")
        hf = AutoConfig.from_pretrained(model_dir)
        if hf.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config: the draft's vocabulary ({hf.vocab_size}) differs from the "
                             f"target's ({target_vocab_size})")
        self.k = k
        model = load_model(model_dir, hf, dtype, device)
        num_blocks = kv_cache_memory_bytes // KVGeometry.of(model).bytes_per_block(block_size, dtype)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, TorchAttention(), device)
        self.max_positions = hf.max_position_embeddings
        self.shadows: dict[str, Request] = {}

    def drop(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Drafts (and, for sampled requests, their draft distributions [n, V]) for (request, limit) pairs."""
        live = []
        for req, limit in wanted:
            limit = min(limit, self.k, self.max_positions - req.num_tokens)
            if limit > 0:
                self._sync(req)
                live.append((req, limit))
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in live}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in live}
        for step in range(max((limit for _, limit in live), default=0)):
            active = [(r, lim) for r, lim in live if step < lim and r.request_id in self.shadows]
            batch = SchedulerOutput()
            for req, _ in active:
                shadow = self.shadows[req.request_id]
                n = shadow.num_tokens - shadow.num_computed_tokens
                if not self.kv.allocate_slots(shadow, n):  # the draft's pool is full: stop drafting for it
                    continue
                batch.scheduled.append(ScheduledRequest(shadow, n))
            if not batch.scheduled:
                break
            logits, rows = self.runner.execute(batch, self.kv)
            for row, s in enumerate(rows):
                shadow, params = s.request, s.request.sampling_params
                if params.greedy:
                    token = int(logits[row].argmax())
                else:
                    q = target_probs(logits[row:row + 1].float().cpu(), params)[0]
                    token = int(torch.multinomial(q, 1, generator=shadow.generator))
                    probs[shadow.request_id].append(q)
                shadow.num_computed_tokens += s.num_tokens
                shadow.append_output_token(token)
                drafts[shadow.request_id].append(token)
        return {rid: (toks, torch.stack(probs[rid]) if probs[rid] else None)
                for rid, toks in drafts.items() if toks}

    def _sync(self, req: Request) -> None:
        """Make the shadow's tokens the target's; keep draft KV for their common prefix."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            # A block size no sequence fills: the shadow never hashes blocks (the draft pool caches none).
            shadow = Request(req.request_id, req.all_token_ids, req.sampling_params, req.eos_token_ids,
                             block_size=1 << 40, max_tokens=req.max_tokens)
            # Draws for sampled drafts come from a generator of their own, so the draft never shifts the
            # target's random stream.
            seed = req.sampling_params.seed
            shadow.generator = torch.Generator().manual_seed(seed if seed is not None else 0)
            self.shadows[req.request_id] = shadow
            return
        target, mine = req.all_token_ids, shadow.all_token_ids
        common = 0
        limit = min(len(target), len(mine), shadow.num_computed_tokens)
        while common < limit and target[common] == mine[common]:
            common += 1
        shadow.all_token_ids = list(target)
        shadow.output_token_ids = []  # the shadow only needs all_token_ids
        shadow.num_computed_tokens = min(common, len(target) - 1)
