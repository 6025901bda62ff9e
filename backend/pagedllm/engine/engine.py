"""LLMEngine: owns the model, the KV cache, the scheduler and the per-request output state.

`add_request` validates and queues; each `step` schedules, runs the model once, samples, applies stop
conditions (finished requests free their blocks at once) and returns the outputs that changed.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagedllm.attention.selector import ProbeShape, select_backend
from pagedllm.config import EngineConfig
from pagedllm.engine.executor import make_executor
from pagedllm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.engine.model_runner import KVGeometry, prepare_step
from pagedllm.engine.observations import ITERATION_TOKENS, ITL, TTFT, Observations
from pagedllm.engine.output_processor import RequestState
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampler import SampledToken, Sampler
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.stop_checker import check_stop
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.stats import SpecDecodeStats
from pagedllm.spec_decode.verifier import verify

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PromptType = str | dict | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.hf_config = AutoConfig.from_pretrained(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.dtype = self._resolve_dtype(config.dtype)
        self.max_model_len = self._resolve_max_model_len()
        self.eos_token_ids = self._eos_token_ids()
        self.vocab_size = self.hf_config.vocab_size
        self.device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.executor = make_executor(config, self.hf_config, self.dtype, self.device)
        try:
            num_blocks = self._init_cache()
            self.proposer = self._make_proposer(config.speculative_config)
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            raise
        self.sampler = Sampler(config.seed)
        self.states: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.observations: Observations | None = None
        self.spec_stats = SpecDecodeStats()
        self.stat_logger = StatLogger(config.log_stats_interval_s) if config.log_stats else None
        logger.info("engine ready: %s, %s on %s, tensor parallel %d, %d KV blocks of %d tokens, max_model_len "
                    "%d", self.hf_config.architectures[0], self.dtype, self.device, config.tensor_parallel_size,
                    num_blocks - 1, config.cache.block_size, self.max_model_len)

    # --- setup helpers ------------------------------------------------------------------
    def _init_cache(self) -> int:
        """Size the KV cache from the budget, pick the attention backend, and set up every rank's runner."""
        cc, sc = self.config.cache, self.config.scheduler
        model = self.executor.model  # rank 0's shard: its KV heads are what one rank's budget holds
        self.kv_geometry = KVGeometry.of(model)
        num_blocks = cc.kv_cache_memory_bytes // self.kv_geometry.bytes_per_block(cc.block_size, self.dtype)
        needed = cdiv(self.max_model_len, cc.block_size) + 1  # one full-length request, plus the null block
        if num_blocks < needed:
            raise ValueError(
                f"kv_cache_memory_bytes: {cc.kv_cache_memory_bytes} bytes hold {num_blocks} blocks; one request of "
                f"max_model_len={self.max_model_len} needs {needed}. Raise the budget or lower max_model_len.")
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens: must be >= max_model_len when chunked prefill is off")
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(sc, self.kv, self.max_model_len)
        self.backend, self.attention_selection = select_backend(self.config.attention_backend,
                                                                  self._probe_shape(model))
        self.executor.init_cache(num_blocks, self.backend)
        return num_blocks

    def _make_proposer(self, spec: dict | None):
        if spec is None:
            return None
        k = spec.get("num_speculative_tokens", 3)
        if spec["method"] == "ngram":
            return NgramProposer(k, spec.get("prompt_lookup_min", 1), spec.get("prompt_lookup_max", 3))
        return DraftModelProposer(spec["model"], k, self.dtype, self.device, self.config.cache.block_size,
                                  spec.get("kv_cache_memory_bytes", self.config.cache.kv_cache_memory_bytes // 4),
                                  self.vocab_size)

    def _probe_shape(self, model) -> ProbeShape:
        """The attention shapes the backends are raced on: those of the model's first layer."""
        attn = model.model.layers[0].self_attn
        return ProbeShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.config.cache.block_size,
                          self.dtype, attn.sliding_window, self.device)

    def _resolve_dtype(self, name: str) -> torch.dtype:
        if name != "auto":
            return _DTYPES[name]
        dt = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(dt, str):
            dt = _DTYPES.get(dt, torch.float32)
        # float16 on CPU is slow and overflow-prone: auto picks bfloat16 there instead.
        return torch.bfloat16 if dt == torch.float16 else (dt or torch.float32)

    def _resolve_max_model_len(self) -> int:
        limit = self.hf_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len: {asked} exceeds the model's max_position_embeddings {limit}")
        return asked or limit

    def _eos_token_ids(self) -> set[int]:
        try:
            eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
        except OSError:
            eos = self.hf_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())

    # --- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt: expected str, dict or list of token ids, got {type(prompt).__name__}")

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, timeout: float | None = None) -> str:
        """Validate and queue a request. Raises ValueError (bad input) or QueueFullError; nothing else changes."""
        if not self.executor.healthy:
            raise RuntimeError(f"engine is not healthy: {self.executor.error}")
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self.validate_prompt(ids)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.monotonic()
        req = Request(request_id, ids, params, self.eos_token_ids, self.config.cache.block_size, prompt=text,
                      priority=priority, arrival_time=now, deadline=None if timeout is None else now + timeout,
                      max_tokens=max_tokens)
        self.scheduler.add_request(req)
        self.states[request_id] = RequestState(req, self.tokenizer)
        return request_id

    def validate_prompt(self, ids: list[int]) -> None:
        """Raise ValueError if these prompt token ids cannot be served (pure: safe from any thread)."""
        if not ids:
            raise ValueError("prompt: is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_model_len="
                             f"{self.max_model_len}")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} are not token ids in [0, {self.vocab_size})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort_request(request_id)
        if req is None or request_id not in self.states:
            return None
        return self._finish_output(req)

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
        outputs = [self._finish_output(r) for r in sched.timed_out]
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.get_stats)
        if sched.is_empty():
            return outputs
        self.num_steps += 1
        obs = self.observations
        if obs is not None:
            obs.add(ITERATION_TOKENS, sched.num_tokens)
        self.prompt_tokens += sum(min(s.num_tokens, max(0, s.request.num_prompt_tokens -
                                                        s.request.num_computed_tokens)) for s in sched.scheduled)
        step, sampling_rows = prepare_step(sched, self.kv, self.config.cache.block_size)
        logits = self.executor.execute_step(step)
        emitted = self._sample(logits, sampling_rows) if sampling_rows else {}
        got = self.scheduler.update_from_output(
            sched, {rid: [t.token_id for t in toks] for rid, toks in emitted.items()})
        now = time.monotonic()
        for req in got:
            if obs is not None:
                if req.first_token_time is None:
                    obs.add(TTFT, now - req.arrival_time)
                else:
                    obs.add(ITL, now - req.last_token_time)
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            state = self.states[req.request_id]
            tokens = emitted[req.request_id]
            before = req.num_output_tokens - len(tokens)
            status = None
            for j, token in enumerate(tokens):  # several with speculation: stop at the first stop
                self.generation_tokens += 1
                status = check_stop(req, self.max_model_len, before + j + 1)
                # An EOS or stop token ends the request without adding its text (as vLLM does).
                stopped_by_token = status == RequestStatus.FINISHED_STOPPED
                status = state.add_token(token, with_text=not stopped_by_token) or status
                if status is not None:
                    req.truncate_output(before + j + 1)
                    break
            if status is not None:
                self.scheduler.finish_request(req, status)
            outputs.append(self._finish_output(req) if req.is_finished else state.make_output())
        return outputs

    def _sample(self, logits: torch.Tensor, rows) -> dict[str, list[SampledToken]]:
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

    def _finish_output(self, req: Request) -> RequestOutput:
        """The single exit of every request that was queued: stop, length, abort or timeout."""
        reason = req.status.finish_reason
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        if self.proposer is not None:
            self.proposer.drop(req.request_id)
        if self.observations is not None:
            self.observations.request_finished(req)
        return self.states.pop(req.request_id).make_output()

    # --- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks_total=self.kv.num_usable_blocks,
            num_blocks_free=self.kv.num_free_blocks,
            kv_cache_usage=self.kv.pool.usage(),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
            attention_backend=self.backend.name,
            attention_selection={"chosen": self.attention_selection.chosen,
                                 "reason": self.attention_selection.reason,
                                 "results": self.attention_selection.results},
            requests_finished=dict(self.requests_finished),
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_accepted_per_position=list(self.spec_stats.accepted_per_position),
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()
