"""LLMEngine: composes the model's executor, the KV cache, the scheduler, the sampler and the output processor.

`add_request` queues a processed request; each `step` reads as its verbs: propose drafts -> schedule ->
execute -> sample -> update progress -> process outputs. Finished requests free their blocks in the same step.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from transformers import AutoTokenizer

from pagedllm.attention.selector import ProbeShape, select_backend
from pagedllm.config import EngineConfig
from pagedllm.engine.executor import make_executor
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.kv_sizing import KVGeometry, check_room_for_one_request
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.observations import ITERATION_TOKENS, ITL, TTFT, Observations
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request
from pagedllm.engine.sampler import SampledToken, Sampler
from pagedllm.engine.scheduler import ScheduledRequest, Scheduler
from pagedllm.engine.spec_decode.registry import make_proposer
from pagedllm.engine.spec_decode.stats import SpecDecodeStats
from pagedllm.engine.spec_decode.verifier import verify
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.step_inputs import prepare_step
from pagedllm.models.layers.fused import load_fused_ops
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.model_info = info = ModelInfo.resolve(config, self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, info)
        self.executor = make_executor(config, info)
        try:
            num_blocks = self._init_cache()
            self.proposer = make_proposer(config, info)
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            raise
        fused = load_fused_ops() if config.fused_cpu_ops else None
        self.sampler = Sampler(config.seed, fused)
        self.output_processor = OutputProcessor(self.tokenizer, info.max_model_len)
        self._ids = itertools.count()
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.observations: Observations | None = None
        self.spec_stats = SpecDecodeStats()
        self.stat_logger = StatLogger(config.log_stats_interval_s) if config.log_stats else None
        logger.info("engine ready: %s, %s on %s, tensor parallel %d, %d KV blocks of %d tokens, max_model_len "
                    "%d", info.architecture, info.dtype, info.device, config.tensor_parallel_size, num_blocks - 1,
                    config.cache.block_size, info.max_model_len)

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    def _init_cache(self) -> int:
        """Size the KV cache from the budget, pick the attention backend, and set up every rank's runner."""
        cc, sc, info = self.config.cache, self.config.scheduler, self.model_info
        model = self.executor.model  # rank 0's shard: its KV heads are what one rank's budget holds
        num_blocks = KVGeometry.of(model).num_blocks(cc.kv_cache_memory_bytes, cc.block_size, info.dtype)
        check_room_for_one_request(num_blocks, cc.kv_cache_memory_bytes, cc.block_size, info.max_model_len)
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < info.max_model_len:
            raise ValueError("max_num_batched_tokens: must be >= max_model_len when chunked prefill is off")
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(sc, self.kv, info.max_model_len)
        attn = model.model.layers[0].self_attn  # the backends are raced on the first layer's shapes
        shape = ProbeShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, cc.block_size, info.dtype,
                           attn.sliding_window, info.device)
        self.backend, self.attention_selection = select_backend(self.config.attention_backend, shape)
        self.executor.init_cache(num_blocks, self.backend)
        return num_blocks

    # --- requests -----------------------------------------------------------------------
    def add_request(self, prompt: PromptType | ProcessedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, timeout: float | None = None) -> str:
        """Queue a request: a ProcessedRequest as it is (already validated), or a prompt with its parameters,
        processed here. Raises ValueError (bad input) or QueueFullError; nothing else changes then."""
        if not self.executor.healthy:
            raise RuntimeError(f"engine is not healthy: {self.executor.error}")
        if isinstance(prompt, ProcessedRequest):
            processed = prompt
        else:
            processed = self.input_processor.process(prompt, params, priority, timeout)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params, ids = processed.params, processed.prompt_token_ids
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.monotonic()
        req = Request(request_id, ids, params, self.model_info.eos_token_ids, self.config.cache.block_size,
                      prompt=processed.prompt, priority=processed.priority, arrival_time=now,
                      deadline=None if processed.timeout is None else now + processed.timeout, max_tokens=max_tokens)
        self.scheduler.add_request(req)
        self.output_processor.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort_request(request_id)
        if req is None:
            return None
        return self._finish(req)

    def enable_observations(self) -> Observations:
        """Start recording per-request and per-step measurements (for an exporter to drain)."""
        if self.observations is None:
            self.observations = Observations()
        return self.observations

    @property
    def healthy(self) -> bool:
        """False once a tensor-parallel worker has failed: the engine cannot run steps any more."""
        return self.executor.healthy

    def shutdown(self) -> None:
        """Stop worker processes (tensor parallelism). Idempotent; the engine cannot step afterwards."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.proposer is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        outputs = [self._finish(r) for r in sched.timed_out]
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.get_stats)
        if sched.is_empty():
            return outputs
        self.num_steps += 1
        if self.observations is not None:
            self.observations.add(ITERATION_TOKENS, sched.num_tokens)
        self.prompt_tokens += sum(min(s.num_tokens, max(0, s.request.num_prompt_tokens -
                                                        s.request.num_computed_tokens)) for s in sched.scheduled)
        step, sampling_rows = prepare_step(sched, self.kv, self.config.cache.block_size)
        logits = self.executor.execute_step(step)
        emitted = self._sample(logits, sampling_rows) if sampling_rows else {}
        got = self.scheduler.update_from_output(
            sched, {rid: [t.token_id for t in toks] for rid, toks in emitted.items()})
        self._record_token_times(got)
        for req in got:
            tokens = emitted[req.request_id]
            before = req.num_output_tokens - len(tokens)
            status = self.output_processor.process_tokens(req, tokens)
            self.generation_tokens += req.num_output_tokens - before
            if status is not None:
                self.scheduler.finish_request(req, status)
                outputs.append(self._finish(req))
            elif (out := self.output_processor.output(req)) is not None:
                outputs.append(out)
        return outputs

    def _record_token_times(self, reqs: list[Request]) -> None:
        now = time.monotonic()
        obs = self.observations
        for req in reqs:
            if obs is not None:
                obs.add(TTFT if req.first_token_time is None else ITL,
                        now - (req.arrival_time if req.first_token_time is None else req.last_token_time))
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> dict[str, list[SampledToken]]:
        """Tokens emitted per request: one from the sampler, or from verifying a request's draft tokens."""
        starts, at = [], 0
        for s in rows:
            starts.append(at)
            at += 1 + len(s.spec_tokens)
        plain = [i for i, s in enumerate(rows) if not s.spec_tokens]
        out: dict[str, list[SampledToken]] = {}
        if plain:
            # Without drafts every row is one plain row, in order: no copy of the logits.
            picked = logits if len(plain) == len(rows) == logits.shape[0] else logits[[starts[i] for i in plain]]
            tokens = self.sampler(picked, [rows[i].request for i in plain])
            out.update({rows[i].request.request_id: [t] for i, t in zip(plain, tokens)})
        for i, s in enumerate(rows):
            k = len(s.spec_tokens)
            if not k:
                continue
            probs = s.request.spec_draft_probs
            ids = verify(logits[starts[i]:starts[i] + k + 1].float().cpu(), s.spec_tokens, s.request,
                         self.sampler.generator, None if probs is None else probs[:k])
            self.spec_stats.record(k, len(ids) - 1)
            out[s.request.request_id] = [SampledToken(t, None, None, None) for t in ids]
        return out

    def _propose_drafts(self) -> None:
        """Draft tokens for running requests that are decoding and whose outputs verification can cover
        exactly (no penalties, logprobs or pending min_tokens: those decode one token at a time)."""
        wanted = []
        for req in self.scheduler.running:
            p = req.sampling_params
            if (req.num_computed_tokens != req.num_tokens - 1 or p.needs_penalties or p.logprobs is not None
                    or req.num_output_tokens < p.min_tokens):
                continue
            wanted.append((req, min(self.max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)))
        drafts = self.proposer.propose(wanted)
        for req, _ in wanted:
            if req.request_id in drafts:
                req.spec_token_ids, req.spec_draft_probs = drafts[req.request_id]

    def _finish(self, req: Request) -> RequestOutput:
        """The single exit of every request that was queued: stop, length, abort or timeout."""
        reason = req.status.finish_reason
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        if self.proposer is not None:
            self.proposer.drop(req.request_id)
        if self.observations is not None:
            self.observations.request_finished(req)
        return self.output_processor.finish(req)

    # --- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        selection = self.attention_selection
        return EngineStats(
            **self.scheduler.stats(), **self.kv.stats(), **self.spec_stats.fields(),
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens, num_steps=self.num_steps,
            requests_finished=dict(self.requests_finished), attention_backend=self.backend.name,
            attention_selection={"chosen": selection.chosen, "reason": selection.reason,
                                 "results": selection.results},
            kernels={"fused_cpu_ops": self.config.fused_cpu_ops, "amx_linear": self.config.amx_linear})

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()
