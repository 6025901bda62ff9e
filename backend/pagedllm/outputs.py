"""Public result types, shaped like vLLM's RequestOutput / CompletionOutput.

An output is a snapshot: its lists are its own, and nothing appends to them after it is made, so another thread
may read it while the engine goes on. What it holds depends on the request's `SamplingParams.output_kind`:
everything so far (CUMULATIVE), what is new since the previous output (DELTA), or the whole result once
(FINAL_ONLY).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless the request asked for logprobs (as in vLLM)
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the request


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of a request's life; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified, and how many were accepted
    num_accepted_draft_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # with finish_reason "error": what failed (this request only)
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None); in DELTA outputs, the first only
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
