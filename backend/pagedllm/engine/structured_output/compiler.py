"""Compiles a request's `StructuredOutputsParams` into a grammar, once per (backend, spec), with the backend it
names or the engine's default (`EngineConfig.structured_outputs_backend`):

- `guidance` (llguidance) or `xgrammar`, the two engines vLLM ships; their matchers share one bitmask layout,
  so the sampler's mask kernel takes either;
- `auto`: guidance. Its mask costs 4-7 µs a row in every JSON state we timed one by one, where xgrammar's
  costs 1-143 µs (bounded integers are its worst); over whole runs its average is lower on two of our three
  schemas (perf/README). An EBNF grammar guidance cannot read (xgrammar's own extensions to GBNF) goes to
  xgrammar. A JSON schema or regex guidance refuses stays refused: xgrammar takes some of those (uniqueItems,
  not, if/then, contains, open-object minProperties) by ignoring the keyword, which would let outputs break
  the schema. If llguidance cannot read the tokenizer at all, auto is xgrammar (logged once).
  (vLLM's auto falls back the other way, from xgrammar.)

Compilation runs where the request is processed (the front end's thread, or the offline caller's), never on
the engine thread, and its errors are ValueErrors that name the field and the problem, so an invalid schema,
regex or grammar is refused before anything is queued.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

from pagedllm.config import STRUCTURED_OUTPUT_BACKENDS
from pagedllm.engine.structured_output.guidance_backend import GuidanceBackend
from pagedllm.engine.structured_output.request_grammar import CompiledGrammar
from pagedllm.engine.structured_output.xgrammar_backend import XGrammarBackend
from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used evicted)
_MAKERS = {"guidance": GuidanceBackend, "xgrammar": XGrammarBackend}
ANY_OBJECT = '{"type": "object"}'  # json_object: OpenAI's "some JSON object" (not any JSON value)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int], default: str = "auto") -> None:
        """`default`: a validated EngineConfig.structured_outputs_backend."""
        self.default = default
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._backends: dict[str, object] = {}  # made on first use (each reads the vocabulary: ~0.3 s)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()  # front ends may process requests on several threads
        self._make_lock = threading.Lock()  # held while a backend reads the vocabulary, not for cache hits

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
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

    def _compile(self, backend: str, spec: StructuredOutputsParams) -> CompiledGrammar:
        kind = spec.kind
        value = getattr(spec, kind)
        if kind == "json_object":
            kind, value = "json", ANY_OBJECT
        elif kind == "json":
            value = value if isinstance(value, str) else json.dumps(value)
            try:  # a schema that is not JSON gets JSON's message, not a converter's
                json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON ({e.msg} at position {e.pos})") from None
        order = [backend]
        if backend == "auto":
            order = ["guidance", "xgrammar"] if kind == "grammar" else ["guidance"]
            if not self._usable("guidance"):
                order = ["xgrammar"]
        first_refusal = None
        for name in order:
            try:
                return self._backend(name).compile(kind, value)
            except ValueError as e:
                first_refusal = first_refusal or f"{e} ({name})"
        raise ValueError(f"structured_outputs.{spec.kind}: {first_refusal}")

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
                    logger.warning("structured output: %s cannot be used (%s); auto compiles with the other", name, e)
                    self._backends[name] = e
            made = self._backends[name]
        if isinstance(made, ValueError):
            raise ValueError(str(made))
        return made
