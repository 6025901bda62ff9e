"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-shaped)."""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable
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
    # The grammar engine: "guidance" (llguidance), "xgrammar", or "auto"; None: the engine's
    # structured_outputs_backend (EngineConfig). pagedllm.engine.structured_output.compiler says what auto picks.
    backend: str | None = None

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
        if self.backend is not None and not isinstance(self.backend, str):  # its value: the grammar compiler's
            raise ValueError(f"structured_outputs.backend: must be a string, got {_show(self.backend)}")

    @classmethod
    def from_dict(cls, spec: dict) -> StructuredOutputsParams:
        if not isinstance(spec, dict):
            raise ValueError(f"structured_outputs: expected an object, got {_show(spec)}")
        known = (*cls.KINDS, "backend")
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise ValueError(f"structured_outputs: unsupported key(s) {unknown}; supported: {', '.join(known)}")
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
        if isinstance(value, dict):  # key order kept: properties are generated in the schema's order
            value = json.dumps(value)
        return self.kind, value if isinstance(value, str) else repr(value)


@dataclass
class SamplingParams:
    """Per-request generation parameters.

    `max_tokens=None` (the default) means "until a stop condition or the context (max_model_len) is full":
    unlike vLLM's default of 16 it never cuts an answer short silently.
    `temperature=0` is greedy decoding. `stop` strings are excluded from the returned text.

    `n` samples are returned (`best_of` >= n drawn, the n with the highest cumulative logprob kept); with a
    seed, sample i draws with seed + i. `beam_width` > 1 is beam search (`LLM.beam_search`, TensorRT-LLM's
    beam_width): the n best beams are returned (transformers' num_return_sequences), ranked by sum of
    logprobs / length ** length_penalty.
    """

    n: int = 1
    best_of: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0  # beam search: a finished beam's score divides by its length to this power
    early_stopping: bool | str = False  # beam search: True, False (a bound decides) or "never" (transformers')
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
    # A streamed request's outputs every this many tokens (its first and last at once); None: the engine's
    # stream_interval, which is also the least a request gets (vLLM's).
    stream_interval: int | None = None
    # Offline only (vLLM's): each called as fn(output_token_ids, logits) or fn(prompt_token_ids,
    # output_token_ids, logits) on the request's fp32 logits row, returning the row to sample from.
    logits_processors: list[Callable] = field(default_factory=list)

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
            ("n", lambda: _int(self.n) and 1 <= self.n <= MAX_SAMPLES, f"must be an integer in [1, {MAX_SAMPLES}]"),
            ("best_of", lambda: self.best_of is None or (_int(self.best_of) and self.n <= self.best_of <= MAX_SAMPLES),
             f"must be an integer in [n, {MAX_SAMPLES}]"),
            ("best_of", lambda: (self.best_of or 1) <= self.n or self.output_kind != RequestOutputKind.DELTA,
             "> n cannot stream (the best samples are known only when all have finished)"),
            ("beam_width", lambda: _int(self.beam_width) and 1 <= self.beam_width <= MAX_SAMPLES,
             f"must be an integer in [1, {MAX_SAMPLES}]"),
            ("length_penalty", lambda: _finite(self.length_penalty), "must be a finite number"),
            ("early_stopping", lambda: self.early_stopping in (True, False, "never"), 'must be true, false or "never"'),
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
            ("stream_interval", lambda: self.stream_interval is None or (
                _int(self.stream_interval) and 1 <= self.stream_interval <= MAX_INT32),
             "must be an integer in [1, 2^31 - 1]"),
            ("stop", lambda: self.detokenize or not self.stop, "stop strings need detokenize=True"),
            ("structured_outputs", lambda: self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams), "must be StructuredOutputsParams"),
            # The grammar ends a constrained output with EOS: a request that may not stop there cannot follow it.
            ("ignore_eos", lambda: not (self.structured_outputs and self.ignore_eos),
             "cannot be combined with structured_outputs (the grammar's end is an EOS token)"),
            ("min_tokens", lambda: not (self.structured_outputs and self.min_tokens),
             "cannot be combined with structured_outputs (the grammar decides where the output ends)"),
            ("logits_processors", lambda: isinstance(self.logits_processors, list) and all(
                callable(f) and num_positional_args(f) in (2, 3) for f in self.logits_processors),
             "must be a list of callables taking (output_token_ids, logits) or (prompt_token_ids, "
             "output_token_ids, logits)"),
        ]
        if _int(self.beam_width) and self.beam_width > 1:
            checks += [(name, ok, f"{msg} with beam search (beam_width > 1)") for name, ok, msg in self._beam_checks()]
        for name, ok, msg in checks:
            if not ok():
                raise ValueError(f"{name}: {msg}, got {_show(getattr(self, name))}")

    def _beam_checks(self) -> list:
        """What beam search does not combine with: it is deterministic, returns final beams (no stream), and
        ranks beams by the raw model's logprobs (nothing may edit them)."""
        return [
            # Beams are scored by the model's own log-probs: temperature 1 (TensorRT-LLM's default) means the same.
            ("temperature", lambda: self.greedy or self.temperature == 1.0, "must be 0 or 1"),
            ("top_p", lambda: self.top_p == 1.0 and self.top_k == 0 and self.min_p == 0.0,
             "(and top_k, min_p) must keep their defaults"),
            ("n", lambda: self.n <= self.beam_width and self.best_of is None,
             "(the best beams returned) must be at most beam_width, and best_of unset"),
            ("output_kind", lambda: self.output_kind != RequestOutputKind.DELTA, "cannot stream"),
            ("stop", lambda: not self.stop, "is not supported"),
            ("logprobs", lambda: self.logprobs in (None, 0), "must be 0 (each token's own) or unset"),
            ("prompt_logprobs", lambda: self.prompt_logprobs is None, "is not supported"),
            ("min_tokens", lambda: not self.min_tokens, "is not supported"),
            ("structured_outputs", lambda: self.structured_outputs is None, "is not supported"),
            ("logits_processors", lambda: not (self.needs_penalties or self.has_token_controls),
             "(and penalties, logit_bias, allowed_token_ids, bad_words) are not supported"),
        ]

    @property
    def num_sequences(self) -> int:
        """How many sequences the request runs at once: its samples, or its beams."""
        return max(self.best_of or self.n, self.beam_width)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_token_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.logits_processors)

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class BeamSearchParams:
    """`LLM.beam_search`'s parameters (vLLM's names; `early_stopping` as transformers'). Beam search here is
    deterministic."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # 0 or 1: beams are scored by the model's own log-probs
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(beam_width=self.beam_width, n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=self.temperature, length_penalty=self.length_penalty,
                              early_stopping=self.early_stopping)


MAX_INT32 = 2 ** 31 - 1
MAX_SAMPLES = 256  # n, best_of, beam_width: each is a sequence in the batch
MAX_SEED = 2 ** 64 - 1


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    """A real number, not NaN or infinite (a bool is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def num_positional_args(fn) -> int | None:
    """How many positional arguments `fn` takes (None if it cannot be told)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


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
