"""Compiles a request's `StructuredOutputsParams` into an xgrammar grammar, once per (tokenizer, spec).

Why xgrammar: it is the engine vLLM and TensorRT-LLM use; its compiled grammars precompute, for every
grammar state, which tokens of the vocabulary can follow, so a step costs one bitmask fill per constrained
row (measured on the tiny model's 2,048-token vocabulary: a JSON schema compiles in under a millisecond,
perf/structured_output.py reports compile and per-step figures). Compilation runs where the request is
processed (the front end's thread, or the offline caller's), never on the engine thread, and its errors
are ValueErrors that name the problem, so an invalid schema or regex is refused before anything is queued.

JSON is compiled without free whitespace between tokens (compact JSON, as `json.dumps(separators=(",", ":"))`
writes it): with arbitrary whitespace allowed, a model may emit whitespace for ever inside a valid prefix.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from pagedllm.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently used evicted)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # front ends may process requests on several threads
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams):
        """The xgrammar CompiledGrammar for `spec`; ValueError naming the problem if it is invalid."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        kind = spec.kind
        where = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                json.loads(schema)  # a schema that is not JSON gets JSON's message, not a converter's
                return self._compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object mode: some JSON object (not any JSON value)
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self._compiler.compile_regex("|".join(f"({_literal(c)})" for c in spec.choice))
            return self._compiler.compile_grammar(spec.grammar)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at position {e.pos})") from None
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{where}: {_reason(e)}") from None


def _literal(text: str) -> str:
    """`text` as a regex matching itself (re.escape also escapes spaces, which xgrammar warns about)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def _reason(err: Exception) -> str:
    """xgrammar's message without its source location prefix ("[09:26:58] /project/cpp/x.cc:94: ...")."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text)
