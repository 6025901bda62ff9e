"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-shaped)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request yields (as vLLM's): each one everything so far, each one what is new since the
    previous (streaming), or one output when the request finishes (offline `LLM.generate`)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request generation parameters.

    `max_tokens=None` (the default) means "until a stop condition or the context (max_model_len) is full":
    unlike vLLM's default of 16 it never cuts an answer short silently.
    `temperature=0` is greedy decoding. `stop` strings are excluded from the returned text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per generated token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", self.n == 1, "only n=1 is supported"),
            ("temperature", _num(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_p", _num(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _int(self.top_k) and self.top_k >= 0, "must be an integer >= 0 (or -1 for all)"),
            ("min_p", _num(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or _int(self.seed), "must be an integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(_int(t) and t >= 0 for t in self.stop_token_ids), "must be token ids >= 0"),
            ("max_tokens", self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1),
             "must be an integer >= 1"),
            ("min_tokens", _int(self.min_tokens) and self.min_tokens >= 0, "must be an integer >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must be <= max_tokens"),
            ("logprobs", self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= 20),
             "must be an integer in [0, 20]"),
            ("presence_penalty", _num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be in [-2, 2]"),
            ("frequency_penalty", _num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be in [-2, 2]"),
            ("repetition_penalty", _num(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be > 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a boolean"),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind), "must be a RequestOutputKind"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise ValueError(f"{name}: {msg}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN
