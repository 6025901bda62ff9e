"""Compiles a request's `StructuredOutputsParams` into a grammar, once per (backend, spec), with the backend it
names or the engine's default (`EngineConfig.structured_outputs_backend`):

- `guidance` (llguidance) or `xgrammar`, the two engines vLLM ships; their matchers share one bitmask layout,
  so the sampler's mask kernel takes either;
- `auto`: guidance, measured faster per step on every schema (perf/structured_output.py). An EBNF grammar
  guidance cannot read (xgrammar's own extensions to GBNF) goes to xgrammar. A JSON schema or regex guidance
  refuses stays refused: xgrammar takes some of those (uniqueItems, not, if/then, lookahead patterns) by
  ignoring the keyword, which would let outputs break the schema. (vLLM's auto falls back from xgrammar.)

Compilation runs where the request is processed (the front end's thread, or the offline caller's), never on
the engine thread, and its errors are ValueErrors that name the field and the problem, so an invalid schema,
regex or grammar is refused before anything is queued.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from pagedllm.engine.structured_output.guidance_backend import GuidanceBackend
from pagedllm.engine.structured_output.xgrammar_backend import XGrammarBackend
from pagedllm.config import STRUCTURED_OUTPUT_BACKENDS
from pagedllm.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently used evicted)
_MAKERS = {"guidance": GuidanceBackend, "xgrammar": XGrammarBackend}


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int], default: str = "auto") -> None:
        if default not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_backend: must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {default!r}")
        self.default = default
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._backends: dict[str, object] = {}  # made on first use (each reads the vocabulary: ~0.3 s)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()  # front ends may process requests on several threads
        self._make_lock = threading.Lock()  # held while a backend reads the vocabulary, not for cache hits
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar for `spec` (its `new_matcher()` starts a request); ValueError naming the problem
        if it is invalid."""
        backend = spec.backend or self.default
        if backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs.backend: must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {backend!r}")
        key = (backend, *spec.key())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(backend, spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, backend: str, spec: StructuredOutputsParams):
        kind = spec.kind
        value = getattr(spec, kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value)
            try:  # a schema that is not JSON gets JSON's message, not a converter's
                json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON ({e.msg} at position {e.pos})") from None
        order = [backend]
        if backend == "auto":
            order = ["guidance", "xgrammar"] if kind == "grammar" else ["guidance"]
            if not self._usable("guidance"):  # llguidance cannot read this tokenizer
                order = ["xgrammar"]
        refusals = []
        for name in order:
            try:
                return self._backend(name).compile(kind, value)
            except ValueError as e:
                refusals.append(f"{e} ({name})")
        raise ValueError(f"structured_outputs.{kind}: {refusals[0]}")

    def _usable(self, name: str) -> bool:
        try:
            self._backend(name)
            return True
        except ValueError:
            return False

    def _backend(self, name: str):
        """The named backend; ValueError if it cannot work with this tokenizer (remembered: it will not change)."""
        with self._make_lock:
            if name not in self._backends:
                try:
                    self._backends[name] = _MAKERS[name](*self._args)
                except ValueError as e:
                    self._backends[name] = e
            made = self._backends[name]
        if isinstance(made, ValueError):
            raise ValueError(str(made))
        return made
