"""Continuous batching at token granularity.

Each step gets a token budget. Running requests are served first (a decode costs one token, an unfinished
prefill as many as fit), then waiting requests are admitted while budget, sequence slots and KV blocks last.
When a running request cannot get a block, requests are preempted by recompute (their blocks freed, their
progress reset) starting from the one that yields first: the most recently admitted (FCFS) or the lowest
priority (priority policy).

Under the "guaranteed_no_evict" capacity policy a new request is admitted only while the pool can also hold the
whole sequences (prompt plus max_tokens) of everything admitted, so running requests do not outgrow the pool.
Preemption stays for what is not growth: the priority policy's, an idle beam's yielding, and LongRoPE's
recompute (its private copies of shared blocks are not counted). A preempted member of a group of beams or
samples comes back as soon as its blocks fit, as under max_utilization, so no group waits on one member's
reservation while the rest of it holds the pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.kv_sizing import cdiv
from pagedllm.engine.request import LONG_ROPE, Request, RequestStatus
from pagedllm.engine.request_queue import make_queue


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_size: the request is rejected, not queued."""


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens of this request computed in this step, draft tokens included
    spec_tokens: list[int] = field(default_factory=list)  # the draft tokens at the end of those

    @property
    def samples(self) -> bool:
        """True when this step brings the request's computed tokens level with its known tokens (drafts are
        computed on top: each gets a logit for its verification)."""
        return self.request.num_computed_tokens + self.num_tokens - len(self.spec_tokens) == \
            self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    timed_out: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 max_loras: int = 0) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct adapters among running requests, at most (0: LoRA off)
        # LongRoPE: a sequence longer than this is recomputed once with the long factors (models/layers/rotary.py)
        self.long_rope_after: int | None = None
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.no_evict = config.capacity_scheduler_policy == "guaranteed_no_evict"

    # --- admission / removal ------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        limit = self.config.max_queue_size
        if limit is not None and len(self.waiting) >= limit and self._num_queued() >= limit:
            raise QueueFullError(f"overloaded: {self._num_queued()} requests waiting (max_queue_size={limit})")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def _num_queued(self) -> int:
        """Waiting requests never admitted: what max_queue_size bounds (preempted ones, and beams parked while
        their group chooses, were admitted once)."""
        return sum(1 for r in self.waiting if r.first_scheduled_time is None)

    def add_fork(self, child: Request, parent: Request) -> None:
        """A sequence forked from `parent` (engine.request_groups): it runs beside its parent on the blocks it
        shares with it, or, if the parent holds none (preempted), waits to be computed afresh."""
        self.requests[child.request_id] = child
        child.first_scheduled_time = parent.first_scheduled_time
        if parent.status == RequestStatus.RUNNING:
            child.set_status(RequestStatus.RUNNING)
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            self.waiting.add_front(child)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish a request in any live state; its blocks go back to the pool at once."""
        if req.is_finished:
            return
        if req.request_id not in self.requests:  # a sample that had not forked yet (request_groups)
            req.set_status(status)
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.set_status(status)
        self.kv.free(req)
        del self.requests[req.request_id]

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict:
        """The EngineStats fields the scheduler owns."""
        stats = {"num_running": len(self.running), "num_waiting": len(self.waiting),
                 "num_preemptions": self.num_preemptions}
        if self.max_loras:  # adapters by name, as vLLM's lora_requests_info labels them
            stats["lora_running"] = sorted({r.lora.lora_name for r in self.running if r.lora is not None})
            stats["lora_waiting"] = sorted({r.lora.lora_name for r in self.waiting if r.lora is not None})
        return stats

    # --- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._expire_deadlines(out)
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        # 1. Running requests, in admission order. Preemption takes victims from the other end.
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if self.long_rope_after is not None and not req.long_rope and req.num_tokens > self.long_rope_after:
                self._recompute_with_long_rope(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:
                continue  # a beam whose candidates are in, waiting for its group to choose (engine.beam_search)
            spec = req.spec_token_ids[:budget - 1] if n == 1 else []  # drafts ride on a decode
            n += len(spec)
            preempted = False
            while not self.kv.allocate_slots(req, n):
                victim = self._pick_victim()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if preempted:  # a victim scheduled earlier in this step gives its tokens back
                budget = self.config.max_num_batched_tokens - out.num_tokens
            if req.status != RequestStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledRequest(req, n, spec))
            budget -= n

        # 2. Waiting requests, unless running ones already had to yield (admitting more would thrash).
        #    Under the priority policy a waiting request that does not fit preempts running requests of
        #    lower priority, lowest first.
        admitting = not out.preempted
        loras = {r.lora.lora_int_id for r in self.running if r.lora is not None} if self.max_loras else set()
        # passed over: a beam preempted while it waits for its group (it has nothing to compute; readmitted, it
        # would take back the room it yielded), or a request whose adapter has no slot while running ones hold them
        passed_over: list[Request] = []
        reserved = self._growth_reserved()
        while admitting and self.waiting and budget > 0:
            req = self.waiting.peek()
            if req.waits_for_group:
                passed_over.append(self.waiting.pop())
                continue
            if self.long_rope_after is not None and not req.long_rope and req.num_tokens > self.long_rope_after:
                req.add_hash_key(LONG_ROPE)  # preempted past the crossing: recomputed with the long factors anyway
            if req.lora is not None and req.lora.lora_int_id not in loras and len(loras) >= self.max_loras:
                holders = self._adapter_outranked_by(req)
                if holders is None:
                    passed_over.append(self.waiting.pop())
                    continue
                for victim in holders:  # priority: the slot's lower-ranked requests yield it
                    self._preempt(victim, out)
                loras.discard(holders[0].lora.lora_int_id)
                budget = self.config.max_num_batched_tokens - out.num_tokens
                reserved = self._growth_reserved()
                continue
            hits, num_hit_tokens = ([], 0)
            if req.num_computed_tokens == 0 and not req.needs_prompt_logits:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit_tokens
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            # A request that will fork into several sequences (n, best_of, beams) is admitted with room for all.
            if len(self.running) + req.seqs_to_reserve <= self.config.max_num_seqs and \
                    self._fits_whole(req, hits, reserved) and self.kv.allocate_slots(req, n, hits):
                self._admit(req, num_hit_tokens, now)
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                if self.no_evict:
                    reserved += self._growth(req)
                if req.lora is not None:
                    loras.add(req.lora.lora_int_id)
                continue
            victim = self._outranked_by(req) or self._idle()
            if victim is None:
                break
            self._preempt(victim, out)
            budget = self.config.max_num_batched_tokens - out.num_tokens
            reserved = self._growth_reserved()
            if victim.lora is not None and not any(r.lora == victim.lora for r in self.running):
                loras.discard(victim.lora.lora_int_id)
        for req in reversed(passed_over):  # back in their places, ahead of everything that arrived after them
            self.waiting.add_front(req)
        return out

    # --- guaranteed_no_evict ------------------------------------------------------------------
    def _whole_blocks(self, req: Request) -> int:
        """Blocks `req` holds at its longest: prompt plus max_tokens (within the context), for each sequence it
        forks into (forks share the prompt's full blocks)."""
        bs = self.kv.block_size
        room = self.max_model_len - req.num_prompt_tokens
        final = cdiv(req.num_prompt_tokens + (room if req.max_tokens is None else min(req.max_tokens, room)), bs)
        return final + (req.seqs_to_reserve - 1) * (final - req.num_prompt_tokens // bs)

    def _growth(self, req: Request) -> int:
        """Blocks a running request may still take from the pool."""
        return max(0, self._whole_blocks(req) - self.kv.num_blocks_held(req.request_id))

    def _growth_reserved(self) -> int:
        """Free blocks the running requests may still take (0 under max_utilization, which reserves nothing)."""
        return sum(self._growth(r) for r in self.running) if self.no_evict else 0

    def _fits_whole(self, req: Request, hits: list, reserved: int) -> bool:
        """Whether admitting `req` keeps room for every admitted sequence's whole length. With nothing running
        it is admitted regardless, so a request longer than the pool still runs (as under max_utilization); so
        is a preempted member of an admitted group (its room was counted with the group's)."""
        rejoining_group = req.group is not None and req.first_scheduled_time is not None
        if not self.no_evict or not self.running or rejoining_group:
            return True
        held_by_others = sum(1 for b in hits if b.ref_cnt > 0)  # prefix hits in use cost no free block
        return self.kv.num_free_blocks - reserved >= self._whole_blocks(req) - held_by_others

    def _recompute_with_long_rope(self, req: Request) -> None:
        """The sequence has passed LongRoPE's original context: its short-factor KV goes, and it is computed again
        with the long factors (as transformers' Phi-3 generate does), under block hashes of its own."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.add_hash_key(LONG_ROPE)

    def _admit(self, req: Request, num_hit_tokens: int, now: float) -> None:
        self.waiting.pop()
        if self.kv.enable_caching:
            self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
        if req.status == RequestStatus.PREEMPTED:
            req.set_status(RequestStatus.WAITING)
        else:
            req.num_cached_tokens = num_hit_tokens
        req.set_status(RequestStatus.RUNNING)
        req.num_computed_tokens = num_hit_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.running.append(req)

    def _outranked_by(self, req: Request) -> Request | None:
        """Priority policy: the running request that yields to `req` (lowest priority, latest arrival), if
        it ranks strictly below `req`."""
        if self.config.scheduling_policy != "priority" or not self.running:
            return None
        victim = self._pick_victim()
        return victim if (victim.priority, victim.arrival_time) > (req.priority, req.arrival_time) else None

    def _adapter_outranked_by(self, req: Request) -> list[Request] | None:
        """Priority policy: the running requests of the adapter that yields its slot to `req` (every one of them
        ranking strictly below it; of such adapters, the one whose best request ranks lowest), or None."""
        if self.config.scheduling_policy != "priority":
            return None
        by_adapter: dict[int, list[Request]] = {}
        for r in self.running:
            if r.lora is not None:
                by_adapter.setdefault(r.lora.lora_int_id, []).append(r)
        rank = (req.priority, req.arrival_time)
        outranked = [rs for rs in by_adapter.values() if all((r.priority, r.arrival_time) > rank for r in rs)]
        return max(outranked, key=lambda rs: min((r.priority, r.arrival_time) for r in rs), default=None)

    def _idle(self) -> Request | None:
        """The latest running sequence with nothing to compute: a beam that has reported its candidates and
        waits for its group. It yields first, so beams that cannot all hold KV at once still take turns
        (its report stays; it waits unadmitted until its group has chosen, and is recomputed when it runs again)."""
        return next((r for r in reversed(self.running) if r.num_computed_tokens == r.num_tokens), None)

    def _pick_victim(self) -> Request:
        idle = self._idle()
        if idle is not None:
            return idle
        if self.config.scheduling_policy == "priority":
            # Lowest priority = largest value; among equals, the latest arrival yields.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.set_status(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0  # recompute: prompt and outputs so far are prefilled again
        req.spec_token_ids, req.spec_draft_probs = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        # The victim may already be in this step's list (it was served before the request that needed room).
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        out.preempted.append(req)
        self.waiting.add_front(req)

    def _expire_deadlines(self, out: SchedulerOutput) -> None:
        now = time.monotonic()
        expired = [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]
        for req in expired:
            self.finish_request(req, RequestStatus.FINISHED_TIMEOUT)
            out.timed_out.append(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance progress counters and append the tokens emitted for requests that reached their end (one
        token, or with speculation the accepted drafts plus one). Returns the requests that got tokens."""
        got_token = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # failed alone during this step (its sampling, say): nothing to advance
                continue
            tokens = sampled.get(req.request_id, []) if s.samples else []  # a beam's are chosen by its group
            # Valid KV this step: the non-draft tokens, plus the drafts that were accepted.
            req.num_computed_tokens += s.num_tokens - len(s.spec_tokens) + max(0, len(tokens) - 1)
            req.spec_token_ids, req.spec_draft_probs = [], None
            for t in tokens:
                req.append_output_token(t)
            self.kv.cache_computed_blocks(req)
            if tokens:
                got_token.append(req)
        return got_token
