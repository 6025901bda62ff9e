"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-shaped)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request yields (as vLLM's): each one everything so far, each one what is new since the
    previous (streaming), or one output when the request finishes (offline `LLM.generate`)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's shape): exactly one of a JSON schema (`json`, a dict or its JSON
    text), any JSON object (`json_object`), a regular expression, a choice among strings, or an EBNF/GBNF
    grammar. The grammar engine (pagedllm.engine.structured_output) compiles it when the request arrives."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(self.KINDS)} is required, got "
                             f"{given or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice: must be a non-empty list of non-empty strings, got "
                                 f"{_show(self.choice)}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string, got {_show(value)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json: must be a JSON schema (an object or its JSON text), got "
                             f"{_show(self.json)}")
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object: must be true, got {_show(self.json_object)}")

    @classmethod
    def from_dict(cls, spec: dict) -> StructuredOutputsParams:
        if not isinstance(spec, dict):
            raise ValueError(f"structured_outputs: expected an object, got {_show(spec)}")
        unknown = sorted(set(spec) - set(cls.KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unsupported key(s) {unknown}; supported: {', '.join(cls.KINDS)}")
        return cls(**spec)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the compile cache's key)."""
        import json

        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):  # the same schema as text or as an object: one key
            try:
                value = json.loads(value)
            except ValueError:
                pass  # not JSON: the compiler refuses it
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value if isinstance(value, str) else repr(value)


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
    # Constrained decoding (a dict is converted): the output follows a JSON schema, a regex, a choice, ...
    structured_outputs: StructuredOutputsParams | None = None
    # Token-level controls (vLLM's): a bias added to chosen tokens' logits (OpenAI's range, [-100, 100]); the
    # only tokens that may be sampled; words never to generate (each tokenized with and without a leading space;
    # a word's last token is banned where the output ends with its other tokens).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # a stop string that ends the output stays in its text
    # Keep only the prompt's last k tokens (vLLM's truncate_prompt_tokens; None keeps all).
    truncate_prompt_tokens: int | None = None
    # False: token ids only, the text stays empty (no stop strings then, as in vLLM).
    detokenize: bool = True
    # Logprobs of the prompt's tokens (vLLM's): per position after the first, the actual token's plus the top k.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.stop = _as_list(self.stop, "stop", str)
        self.bad_words = _as_list(self.bad_words, "bad_words", str)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list(self.allowed_token_ids, "allowed_token_ids", int)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids", int)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Raise ValueError naming the first field out of range. Checks run in order and each only after the
        ones before it held, so a value of the wrong type never reaches a comparison."""
        checks = [
            ("n", lambda: self.n == 1, "only n=1 is supported"),
            ("temperature", lambda: _finite(self.temperature) and self.temperature >= 0, "must be a finite number >= 0"),
            ("top_p", lambda: _finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", lambda: _int(self.top_k) and 0 <= self.top_k <= MAX_INT32,
             "must be an integer >= 0 (or -1 for all)"),
            ("min_p", lambda: _finite(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", lambda: self.seed is None or (_int(self.seed) and 0 <= self.seed <= MAX_SEED),
             "must be an integer in [0, 2^64 - 1]"),
            ("stop", lambda: all(self.stop), "must be non-empty strings"),
            ("stop_token_ids", lambda: all(t >= 0 for t in self.stop_token_ids), "must be token ids >= 0"),
            ("max_tokens", lambda: self.max_tokens is None or (_int(self.max_tokens) and 1 <= self.max_tokens
                                                               <= MAX_INT32), "must be an integer in [1, 2^31 - 1]"),
            ("min_tokens", lambda: _int(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT32,
             "must be an integer in [0, 2^31 - 1]"),
            ("min_tokens", lambda: self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must be <= max_tokens"),
            ("logprobs", lambda: self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= MAX_INT32),
             "must be an integer >= 0"),
            ("presence_penalty", lambda: _finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be in [-2, 2]"),
            ("frequency_penalty", lambda: _finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be in [-2, 2]"),
            ("repetition_penalty", lambda: _finite(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be a finite number > 0"),
            ("ignore_eos", lambda: isinstance(self.ignore_eos, bool), "must be a boolean"),
            ("skip_special_tokens", lambda: isinstance(self.skip_special_tokens, bool), "must be a boolean"),
            ("output_kind", lambda: isinstance(self.output_kind, RequestOutputKind), "must be a RequestOutputKind"),
            ("logit_bias", lambda: self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                _int(k) and k >= 0 and _finite(v) and -100 <= v <= 100 for k, v in self.logit_bias.items())),
             "must map token ids to numbers in [-100, 100]"),
            ("allowed_token_ids", lambda: self.allowed_token_ids is None
             or (bool(self.allowed_token_ids) and all(t >= 0 for t in self.allowed_token_ids)),
             "must be a non-empty list of token ids"),
            ("bad_words", lambda: all(self.bad_words), "must be non-empty strings"),
            ("include_stop_str_in_output", lambda: isinstance(self.include_stop_str_in_output, bool),
             "must be a boolean"),
            ("truncate_prompt_tokens", lambda: self.truncate_prompt_tokens is None or (
                _int(self.truncate_prompt_tokens) and 1 <= self.truncate_prompt_tokens <= MAX_INT32),
             "must be an integer in [1, 2^31 - 1]"),
            ("detokenize", lambda: isinstance(self.detokenize, bool), "must be a boolean"),
            ("prompt_logprobs", lambda: self.prompt_logprobs is None or (
                _int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_INT32), "must be an integer >= 0"),
            ("stop", lambda: self.detokenize or not self.stop, "stop strings need detokenize=True"),
            ("structured_outputs", lambda: self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams), "must be StructuredOutputsParams"),
            # The grammar ends a constrained output with EOS: a request that may not stop there cannot follow it.
            ("ignore_eos", lambda: not (self.structured_outputs and self.ignore_eos),
             "cannot be combined with structured_outputs (the grammar's end is an EOS token)"),
            ("min_tokens", lambda: not (self.structured_outputs and self.min_tokens),
             "cannot be combined with structured_outputs (the grammar decides where the output ends)"),
        ]
        for name, ok, msg in checks:
            if not ok():
                raise ValueError(f"{name}: {msg}, got {_show(getattr(self, name))}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_token_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


MAX_INT32 = 2 ** 31 - 1
MAX_SEED = 2 ** 64 - 1


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    """A real number, not NaN or infinite (a bool is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _as_list(value, name: str, kind: type) -> list:
    """A string (for stop) or a list of values of `kind`, as a list; anything else is a ValueError."""
    if value is None:
        return []
    if kind is str and isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) and not isinstance(v, bool)
                                                        for v in value):
        raise ValueError(f"{name}: must be a list of {'strings' if kind is str else 'token ids'}, got {_show(value)}")
    return list(value)


def _token_key(key):
    """logit_bias keys: token ids, or their decimal strings (OpenAI's JSON keys are strings)."""
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
        return int(key)
    return key


def _show(value) -> str:
    """A value for an error message: one short line, whatever its size."""
    big = isinstance(value, int) and value.bit_length() > 100  # repr of a huge int is long, or even refused
    text = f"an integer of {value.bit_length()} bits" if big else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
