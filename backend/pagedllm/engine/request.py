"""A request's state: its tokens, its progress counter and its lifecycle status.

The single progress rule (GUIDE.md): `num_computed_tokens` catches up with `num_tokens`. Prefill, chunked
prefill, prefix-cache hits and recompute after preemption all fall out of it: whatever is between the two
counters is scheduled next, and a token is sampled whenever a step brings them level.
"""

from __future__ import annotations

import enum
import time

import torch

from pagedllm.engine.block_hash import BlockHash, hash_block_tokens
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_TIMEOUT = 6
    FINISHED_ERROR = 7  # a failure that belongs to this request alone (Request.error says what)

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
    RequestStatus.FINISHED_ERROR: "error",
}

_FINISHED = {s for s in RequestStatus if s.is_finished}
# The only legal moves; `Request.set_status` is the one place they are checked.
_TRANSITIONS = {
    RequestStatus.WAITING: {RequestStatus.RUNNING} | _FINISHED,
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED} | _FINISHED,
    RequestStatus.PREEMPTED: {RequestStatus.WAITING} | _FINISHED,
}


LONG_ROPE = ("rope", "long")  # the block-hash key of a LongRoPE sequence in its long factors


class InvalidTransition(RuntimeError):
    pass


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        block_size: int,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        deadline: float | None = None,
        max_tokens: int | None = None,
        lora: LoRARequest | None = None,
        hash_keys: tuple = (),
    ) -> None:
        """`hash_keys`: what its KV depends on beyond the tokens and the adapter (rope regimes, engine.add_request)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.deadline = deadline  # monotonic time after which the request finishes with "timeout"
        self.max_tokens = max_tokens  # effective limit: params.max_tokens capped by the context
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it finished with FINISHED_ERROR

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step, not yet verified
        self.bad_words_token_ids: list[list[int]] = []  # sampling_params.bad_words, tokenized
        # sampling_params.prompt_logprobs: one entry per prompt token so far (the first None), filled as the
        # prompt's logits come back (engine.prompt_logprobs)
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None
        self.grammar = None  # RequestGrammar of a structured-output request (engine.structured_output)
        self.spec_draft_probs = None  # their draft distributions [k, V] when a sampled draft model made them
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.group = None  # the SampleGroup or BeamGroup this sequence belongs to (engine.request_groups)
        self.seqs_to_reserve = 1  # sequence slots admission must find: more while forks are still to come
        # a beam whose next-token row is with its group: it has nothing to compute until the group chooses
        self.waits_for_group = False
        self.num_draft_tokens = 0  # speculative decoding: draft tokens verified for this request, and accepted
        self.num_accepted_draft_tokens = 0

        self.lora = lora  # the adapter it runs with: its id keys every block hash (adapters never share KV)
        # what else changes its KV beyond the tokens, in every block hash
        self.hash_keys: tuple = ((("lora", lora.lora_int_id),) if lora is not None else ()) + tuple(hash_keys)
        self.lora_weights = None  # its LoRAAdapter, brought by the request (slots are filled from it)
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

        # Timestamps (monotonic) for metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    # --- tokens -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """True while prompt logprobs are asked for and not all recorded: its prompt rows return logits (and it
        takes nothing from the prefix cache, whose positions would never be computed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def fork(self, request_id: str) -> Request:
        """A copy of this sequence's tokens and progress under a new id (its blocks are shared by the KV
        manager's `fork`); its status is WAITING until the scheduler places it. Beams fork; a constrained
        sequence cannot (its grammar matcher is its own), nor can structured output run beam search."""
        if self.grammar is not None:
            raise ValueError("a sequence with a grammar cannot fork")
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.request_id = request_id
        child.status = RequestStatus.WAITING
        child.all_token_ids = list(self.all_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.spec_token_ids, child.spec_draft_probs = [], None
        child.prompt_logprobs = None
        child.seqs_to_reserve = 1
        child.waits_for_group = False  # it has its own row to compute
        child.generator = None  # beams do not sample
        return child

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens after the first `num_output_tokens` (a stop inside an accepted speculative
        run). Only for a request about to finish: its KV and block hashes are not rolled back."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]

    @property
    def long_rope(self) -> bool:
        """LongRoPE: its KV is computed with the long factors (engine.scheduler)."""
        return LONG_ROPE in self.hash_keys

    def add_hash_key(self, key) -> None:
        """Something more that its KV depends on: every block hash is recomputed with it."""
        self.hash_keys += (key,)
        self.block_hashes = []
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Hash every newly completed full block, chained to its parent's hash."""
        bs = self.block_size
        extra = self.hash_keys
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block_tokens(parent, self.all_token_ids[i * bs:(i + 1) * bs], extra))

    # --- lifecycle --------------------------------------------------------------------------
    def set_status(self, new: RequestStatus) -> None:
        if new not in _TRANSITIONS.get(self.status, ()):
            raise InvalidTransition(f"request {self.request_id}: {self.status.name} -> {new.name} is not allowed")
        self.status = new
        if new.is_finished:
            self.finished_time = time.monotonic()

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens})")
