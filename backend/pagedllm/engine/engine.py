"""LLMEngine: composes the model's executor, the KV cache, the scheduler, the sampler and the output processor.

`add_request` queues a processed request; each `step` reads as its verbs: propose drafts -> schedule ->
execute -> sample -> update progress -> process outputs. Finished requests free their blocks in the same step.

Fault isolation: a failure that belongs to one request (its draft proposal, sampling or logits processing, its
verification, its detokenization and stop checks) finishes that request alone, with finish_reason "error" and
the message; its blocks go back and the step goes on for the others. Only a failure of the shared machinery
(the forward pass, the KV pool, a tensor-parallel worker) escapes `step`: the engine is then dead.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from pagedllm.attention.selector import ProbeShape, select_backend
from pagedllm.engine.decode_graphs import capture_sizes, graphs_unsupported
from pagedllm.config import EngineConfig
from pagedllm.engine.executor import make_executor
from pagedllm.engine.faults import FaultInjector
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedllm.engine.kv_budget import kv_budget_bytes
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.kv_sizing import KVGeometry, check_room_for_one_request
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.observations import ITERATION_TOKENS, ITL, TTFT, Observations
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.prompt_logprobs import record_prompt_logprobs
from pagedllm.engine.request import LONG_ROPE, Request, RequestStatus
from pagedllm.engine.request_groups import RequestGroups
from pagedllm.engine.sampler import SampledToken, Sampler
from pagedllm.engine.scheduler import ScheduledRequest, Scheduler
from pagedllm.engine.spec_decode.registry import make_proposer
from pagedllm.engine.spec_decode.stats import SpecDecodeStats
from pagedllm.engine.spec_decode.verifier import verify
from pagedllm.engine.structured_output.request_grammar import GrammarMasks, RequestGrammar
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.engine.startup import StartupPhases
from pagedllm.engine.lora_slots import LoRASlots
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.step_inputs import prepare_step
from pagedllm.engine.kv_calibration import CALIBRATION_TEXT
from pagedllm.models.checkpoint import load_tokenizer
from pagedllm.models.layers.rotary import original_context, rope_type
from pagedllm.models.layers.fused import load_fused_ops, load_token_mask
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.startup = startup = StartupPhases()
        with startup.phase("tokenizer and config"):
            self.tokenizer = load_tokenizer(config.model, config.tokenizer)
            self.model_info = info = ModelInfo.resolve(config, self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, info, config.limits, config.chat_template, config.lora,
                                              config.structured_outputs_backend)
        self.input_processor.loras.check_declared()  # a broken declared adapter fails the start, naming it
        # dynamic NTK rope: prompts longer than this are rotated for their own length (models/layers/rotary.py)
        self.long_prompt_rope = original_context(info.hf_config) if rope_type(info.hf_config) == "dynamic" else None
        with startup.phase("weights", f"{config.model}, {info.dtype} on {info.device}, tensor parallel "
                                      f"{config.tensor_parallel_size}"):
            self.executor = make_executor(config, info)
        try:
            num_blocks = self._init_cache()
            if config.speculative_config is None:
                self.proposer = None
            else:
                with startup.phase(f"{config.speculative_config.method} proposer"):
                    self.proposer = make_proposer(self.config, info)  # with the resolved KV budget
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            raise
        self.sampler = Sampler(config.seed, load_fused_ops(info.device) if config.fused_cpu_ops else None)
        self.grammar_masks = GrammarMasks(load_token_mask(info.device) if config.fused_cpu_ops else None)
        self.output_processor = OutputProcessor(self.tokenizer, info.max_model_len,
                                                config.scheduler.stream_interval)
        self.groups = RequestGroups(self.scheduler, self.kv, self.output_processor, info.eos_token_ids,
                                    lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        self._ids = itertools.count()
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.observations: Observations | None = None
        self.spec_stats = SpecDecodeStats()
        self.stat_logger = StatLogger(config.log_stats_interval_s) if config.log_stats else None
        self.faults = FaultInjector(config.fault_injection) if config.fault_injection is not None else None
        logger.info("engine ready in %s: %s, %s on %s, tensor parallel %d, %d KV blocks of %d tokens, "
                    "max_model_len %d", startup.summary(), info.architecture, info.dtype, info.device,
                    config.tensor_parallel_size, num_blocks - 1, config.cache.block_size, info.max_model_len)

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    def _init_cache(self) -> int:
        """Size the KV cache from the budget, pick the attention backend, and set up every rank's runner."""
        cc, sc, info = self.config.cache, self.config.scheduler, self.model_info
        spec = self.config.speculative_config
        # decode CUDA graphs keep one step of up to max_num_seqs tokens in their pool for good: reserved too
        graph_tokens = sc.max_num_seqs if info.device.startswith("cuda") and not self.config.enforce_eager else 0
        budget = kv_budget_bytes(cc, info.device, info.hf_config, info.dtype,
                                 sc.max_num_batched_tokens + graph_tokens, sc.max_num_seqs,
                                 self.config.tensor_parallel_size, shared_with_draft=spec is not None and spec.method == "draft_model"
                                 and spec.kv_cache_memory_bytes is None)
        # from here on the config states the budget in bytes (the draft model's KV is sized from it)
        cc = dataclasses.replace(cc, kv_cache_memory_bytes=budget, gpu_memory_utilization=None)
        self.config = dataclasses.replace(self.config, cache=cc)
        model = self.executor.model  # rank 0's shard: its KV heads are what one rank's budget holds
        num_blocks = KVGeometry.of(model).num_blocks(budget, cc.block_size, info.kv_dtype)
        check_room_for_one_request(num_blocks, budget, cc.block_size, info.max_model_len)
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < info.max_model_len:
            raise ValueError("max_num_batched_tokens: must be >= max_model_len when chunked prefill is off")
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        lora = self.config.lora
        self.scheduler = Scheduler(sc, self.kv, info.max_model_len, lora.max_loras if lora.enable_lora else 0)
        if rope_type(info.hf_config) == "longrope":
            self.scheduler.long_rope_after = original_context(info.hf_config)
        running = self.scheduler.running
        self.lora_slots = LoRASlots(lora.max_loras, lambda: {r.lora.lora_int_id for r in running if r.lora}) \
            if lora.enable_lora else None
        attn = model.model.layers[0].self_attn  # the backends are raced on the first layer's shapes
        window = next((layer.self_attn.sliding_window for layer in model.model.layers
                       if layer.self_attn.sliding_window), None)  # and a sliding window, if a layer has one
        shape = ProbeShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, cc.block_size, info.dtype, window,
                           info.device, getattr(attn, "softcap", None), info.kv_dtype)
        with self.startup.phase("attention backend selection"):
            self.backend, self.attention_selection = select_backend(
                self.config.attention_backend, shape, self.config.amx_attention)
        with self.startup.phase("KV cache", f"{num_blocks - 1} blocks of {cc.block_size} tokens, {info.kv_dtype}"):
            self.executor.init_cache(num_blocks, self.backend, self._calibration_ids(num_blocks))
        self.decode_graphs = self._capture_decode_graphs(model)
        return num_blocks

    def _calibration_ids(self, num_blocks: int) -> list[int] | None:
        """With calculate_kv_scales: the calibration text's tokens, as many as one prompt and the pool can take."""
        if not self.config.cache.calculate_kv_scales:
            return None
        ids = self.tokenizer.encode(CALIBRATION_TEXT)
        return ids[:min(self.max_model_len - 1, (num_blocks - 1) * self.config.cache.block_size)]

    def _capture_decode_graphs(self, model) -> dict:
        """Decode CUDA graphs where they can run (else why not): {"sizes": captured buckets, "reason": ...}."""
        cfg = self.config
        why = "enforce_eager" if cfg.enforce_eager else graphs_unsupported(
            model, self.backend, self.model_info.device, cfg.tensor_parallel_size)
        if why is not None and cfg.cuda_graph_sizes is not None:  # (EngineConfig refuses them with enforce_eager)
            raise ValueError(f"cuda_graph_sizes: decode CUDA graphs cannot run here: {why}")
        if why is not None:
            logger.info("decode CUDA graphs: off (%s)", why)
            return {"sizes": [], "reason": why}
        sizes = capture_sizes(cfg.scheduler.max_num_seqs, cfg.cuda_graph_sizes)
        with self.startup.phase("decode CUDA graphs", f"{len(sizes)} buckets up to {max(sizes)}"):
            captured = self.executor.capture_decode_graphs(sizes, self.max_model_len)
        return {"sizes": list(captured), "reason": "captured" if captured else "capture failed (see the log)"}

    # --- requests -----------------------------------------------------------------------
    def add_request(self, prompt: PromptType | ProcessedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, timeout: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request: a ProcessedRequest as it is (already validated), or a prompt with its parameters
        (and adapter), processed here. Raises ValueError (bad input) or QueueFullError; nothing else changes
        then."""
        if not self.executor.healthy:
            raise RuntimeError(f"engine is not healthy: {self.executor.error}")
        if isinstance(prompt, ProcessedRequest):
            processed = prompt
        else:
            processed = self.input_processor.process(prompt, params, priority, timeout, lora_request)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.scheduler.requests or request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params = processed.params
        if (processed.lora is None) != (processed.lora_weights is None):
            raise ValueError("lora_request: a processed request needs its adapter's weights (InputProcessor)")
        if params.num_sequences > self.config.scheduler.max_num_seqs:
            raise ValueError(f"{'beam_width' if params.beam_width > 1 else 'n'}: {params.num_sequences} sequences "
                             f"run at once, more than max_num_seqs={self.config.scheduler.max_num_seqs}")
        arrival = time.monotonic() if processed.arrival_time is None else processed.arrival_time

        def make(rid: str, sp: SamplingParams) -> Request:
            ids = processed.prompt_token_ids
            room = self.max_model_len - len(ids)
            req = Request(rid, ids, sp, self.model_info.eos_token_ids, self.config.cache.block_size,
                          prompt=processed.prompt, priority=processed.priority, arrival_time=arrival,
                          deadline=None if processed.timeout is None else arrival + processed.timeout,
                          max_tokens=room if sp.max_tokens is None else min(sp.max_tokens, room),
                          lora=processed.lora, hash_keys=self._rope_hash_keys(len(ids)))
            req.lora_weights = processed.lora_weights
            if processed.grammar is not None:
                req.grammar = RequestGrammar(processed.grammar)
            req.bad_words_token_ids = [list(w) for w in processed.bad_words_token_ids]
            return req

        if params.num_sequences > 1:
            self.groups.add(request_id, params, make)
            return request_id
        req = make(request_id, params)
        self.scheduler.add_request(req)
        self.output_processor.add_request(req)
        return request_id

    def _rope_hash_keys(self, prompt_len: int) -> tuple:
        """What a prompt's rope regime adds to its block hashes: dynamic NTK rotates a long prompt's tokens for its
        own length (its blocks are its alone); LongRoPE starts a prompt past the original context in the long
        factors."""
        if self.long_prompt_rope is not None and prompt_len > self.long_prompt_rope:
            return (("rope_length", prompt_len),)
        if self.scheduler.long_rope_after is not None and prompt_len > self.scheduler.long_rope_after:
            return (LONG_ROPE,)
        return ()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples or beams); its final output, or None if it is not live."""
        outputs = []
        for req in self.groups.members(request_id) or [self.scheduler.requests.get(request_id)]:
            if req is not None and self.scheduler.abort_request(req.request_id) is not None:
                outputs += self._finish(req)
        return outputs[-1] if outputs else None

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
        outputs = self._propose_drafts() if self.proposer is not None else []
        sched = self.scheduler.schedule()
        for r in sched.timed_out:
            outputs += self._finish(r)
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.get_stats)
        if sched.is_empty():
            return outputs
        self.num_steps += 1
        if self.observations is not None:
            self.observations.add(ITERATION_TOKENS, sched.num_tokens)
        self.prompt_tokens += sum(min(s.num_tokens, max(0, s.request.num_prompt_tokens -
                                                        s.request.num_computed_tokens)) for s in sched.scheduled)
        step, sampling_rows, prompt_logits = prepare_step(sched, self.kv, self.config.cache.block_size,
                                                          self.lora_slots)
        if self.faults is not None:
            self.faults.check("forward", [s.request for s in sched.scheduled])
        logits = self.executor.execute_step(step)
        if prompt_logits is not None:  # prompt logprobs recorded, and their rows dropped before sampling
            tok = self.output_processor.tokenizer
            for s, at, first, n in prompt_logits.rows:
                decode = (lambda t: tok.decode([t])) if s.request.sampling_params.detokenize else None
                record_prompt_logprobs(s.request, logits[at:at + n], first, decode)
            logits = logits[prompt_logits.keep]
        emitted = self._sample(logits, sampling_rows, outputs) if sampling_rows else {}
        got = self.scheduler.update_from_output(
            sched, {rid: [t.token_id for t in toks] for rid, toks in emitted.items()})
        got += self.groups.after_step(emitted, outputs)  # samples fork, beams choose
        self._record_token_times(got)
        for req in got:
            tokens = emitted[req.request_id]
            before = req.num_output_tokens - len(tokens)
            try:
                if self.faults is not None:
                    self.faults.check("detokenize", [req])
                status = self.output_processor.process_tokens(req, tokens)
                out = self.output_processor.output(req) if status is None else None
            except Exception as e:
                outputs += self._fail_request(req, e)
                continue
            self.generation_tokens += req.num_output_tokens - before
            if status is not None:
                self.scheduler.finish_request(req, status)
                outputs += self._finish(req)
            elif out is not None:
                outputs.append(out if req.group is None else req.group.merge(out))
        return [o for o in outputs if o is not None]

    def _fail_request(self, req: Request, err: Exception) -> list[RequestOutput]:
        """Finish `req` alone after a failure of its own; the step goes on for the others."""
        req.error = f"{type(err).__name__}: {err}"
        logger.warning("request %s failed (the others go on): %s", req.request_id, req.error, exc_info=err)
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR)
        return self._finish(req)

    def _record_token_times(self, reqs: list[Request]) -> None:
        now = time.monotonic()
        obs = self.observations
        for req in reqs:
            if obs is not None:
                obs.add(TTFT if req.first_token_time is None else ITL,
                        now - (req.arrival_time if req.first_token_time is None else req.last_token_time))
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRequest],
                outputs: list[RequestOutput]) -> dict[str, list[SampledToken]]:
        """Tokens emitted per request: one from the sampler, or from verifying a request's draft tokens. A
        request whose sampling or verification fails is finished with an error (its output joins `outputs`)."""
        starts, at = [], 0
        for s in rows:
            starts.append(at)
            at += 1 + len(s.spec_tokens)
        plain = [i for i, s in enumerate(rows) if not s.spec_tokens]
        out: dict[str, list[SampledToken]] = {}
        if plain:
            # Without drafts every row is one plain row, in order: no copy of the logits.
            picked = logits if len(plain) == len(rows) == logits.shape[0] else logits[[starts[i] for i in plain]]
            reqs = [rows[i].request for i in plain]
            # The constrained rows' grammar masks (in place; the others untouched; constrained requests have no
            # drafts). With a GPU the forward pass may still be running: the fill overlaps it. A request whose
            # matcher failed fails alone.
            failed = self.grammar_masks.apply(picked, reqs)
            if failed:
                for j, err in failed.items():
                    outputs += self._fail_request(reqs[j], err)
                kept = [j for j in range(len(reqs)) if j not in failed]
                picked, reqs = picked[kept], [reqs[j] for j in kept]
            keep, extra = self.groups.route_rows(picked, reqs)  # beams report; waiting samples join
            if len(keep) < len(reqs) or extra:
                picked = picked[keep + [j for j, _ in extra]]
                reqs = [reqs[j] for j in keep] + [sib for _, sib in extra]
            for req, token in zip(reqs, self._sample_isolated(picked, reqs, outputs) if reqs else ()):
                if token is not None:
                    out[req.request_id] = [token]
        for i, s in enumerate(rows):
            k = len(s.spec_tokens)
            if not k:
                continue
            probs = s.request.spec_draft_probs
            try:
                ids = verify(logits[starts[i]:starts[i] + k + 1].float().cpu(), s.spec_tokens, s.request,
                             self.sampler.generator, None if probs is None else probs[:k])
            except Exception as e:
                outputs += self._fail_request(s.request, e)
                continue
            self.spec_stats.record(k, len(ids) - 1)
            s.request.num_draft_tokens += k
            s.request.num_accepted_draft_tokens += len(ids) - 1
            out[s.request.request_id] = [SampledToken(t, None, None, None) for t in ids]
        return out

    def _sample_isolated(self, logits: torch.Tensor, reqs: list[Request],
                         outputs: list[RequestOutput]) -> list[SampledToken | None]:
        """The batch's tokens. If the batch fails, each request is sampled alone to find whose failure it was:
        those requests finish with an error (None in their place), the others keep their tokens."""
        try:
            if self.faults is not None:
                self.faults.check("sample", reqs)
            return self.sampler(logits, reqs)
        except Exception:
            tokens = []
            for row, req in enumerate(reqs):
                try:
                    if self.faults is not None:
                        self.faults.check("sample", [req])
                    tokens.append(self.sampler(logits[row:row + 1], [req])[0])
                except Exception as e:
                    outputs += self._fail_request(req, e)
                    tokens.append(None)
            return tokens

    def _propose_drafts(self) -> list[RequestOutput]:
        """Draft tokens for running requests that are decoding and whose outputs verification can cover
        exactly (no penalties, logprobs or pending min_tokens: those decode one token at a time). Returns the
        outputs of requests whose proposal failed (each finished with an error)."""
        wanted = []
        for req in self.scheduler.running:
            p = req.sampling_params
            # Constrained requests (a grammar, token controls) are not speculated: verification knows neither.
            if (req.num_computed_tokens != req.num_tokens - 1 or p.needs_penalties or p.logprobs is not None
                    or req.num_output_tokens < p.min_tokens or req.grammar is not None or p.has_token_controls
                    or p.beam_width > 1):
                continue
            wanted.append((req, min(self.max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)))
        failed: list[RequestOutput] = []
        try:
            if self.faults is not None:
                self.faults.check("propose", [r for r, _ in wanted])
            drafts = self.proposer.propose(wanted)
        except Exception:
            # Whose failure was it? Start every request's proposal state afresh and propose for each alone.
            for req, _ in wanted:
                self.proposer.drop(req.request_id)
            drafts = {}
            for item in wanted:
                try:
                    if self.faults is not None:
                        self.faults.check("propose", [item[0]])
                    drafts.update(self.proposer.propose([item]))
                except Exception as e:
                    failed += self._fail_request(item[0], e)
        for req, _ in wanted:
            if req.request_id in drafts:
                req.spec_token_ids, req.spec_draft_probs = drafts[req.request_id]
        return failed

    def _finish(self, req: Request) -> list[RequestOutput]:
        """The single exit of every sequence that was queued: stop, length, abort, timeout or error. Returns the
        caller's outputs it completes (a group's sequence may complete none, or a stream's delta)."""
        if self.proposer is not None:
            self.proposer.drop(req.request_id)
        outputs = [self.output_processor.finish(req)] if req.group is None else self.groups.finished(req)
        for out in outputs:
            if out.finished:  # one count per caller's request, whatever its number of sequences
                # Observed before counted: an exporter that reads the counts, then drains the observations,
                # never sees a finished request whose measurements are not queued yet.
                if self.observations is not None:
                    self.observations.request_finished(req)
                reason = req.status.finish_reason
                self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        return outputs

    # --- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        selection = self.attention_selection
        return EngineStats(
            **self.scheduler.stats(), **self.kv.stats(), **self.spec_stats.fields(),
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens, num_steps=self.num_steps,
            requests_finished=dict(self.requests_finished), attention_backend=self.backend.name,
            attention_selection={"chosen": selection.chosen, "reason": selection.reason,
                                 "results": selection.results},
            kernels={"fused_cpu_ops": self.config.fused_cpu_ops, "amx_linear": self.config.amx_linear,
                     "amx_attention": self.config.amx_attention, "cpu_decoder_loop": self.config.cpu_decoder_loop,
                     "cpu_malloc_tuning": self.config.cpu_malloc_tuning},
            decode_graphs=dict(self.decode_graphs), moe_expert_tokens=self._expert_tokens(),
            lora_max=self.lora_slots.max_loras if self.lora_slots else 0,
            lora_loads=self.lora_slots.num_loads if self.lora_slots else 0)

    def _expert_tokens(self) -> dict[int, list[int]]:
        counts = {}
        for i, layer in enumerate(self.executor.model.model.layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is not None and hasattr(experts, "expert_tokens"):
                counts[i] = experts.expert_tokens.tolist()
        return counts

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()
