"""xgrammar as a grammar backend: a spec compiles once into a CompiledGrammar; each request gets a matcher.

xgrammar precomputes, per grammar state, which tokens can follow; its fill is cheap where that settles the
mask (1-25 µs per row on a 32k vocabulary) and costly where many tokens stay context-dependent (bounded
integers: ~70-140 µs), see perf/structured_output.py. JSON is compiled without free whitespace, with
json.dumps' default separators (", " and ": "): with arbitrary whitespace allowed, a model may emit
whitespace for ever inside a valid prefix.
"""

from __future__ import annotations

import re

from pagedllm.engine.structured_output.request_grammar import CompiledGrammar

NAME = "xgrammar"


class XGrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, value) -> CompiledGrammar:
        """ValueError with xgrammar's reason for an invalid spec."""
        try:
            if kind == "json":
                compiled = self._compiler.compile_json_schema(value, any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(value)
            elif kind == "choice":
                compiled = self._compiler.compile_regex("|".join(f"({_literal(c)})" for c in value))
            else:
                compiled = self._compiler.compile_grammar(value)
        except (RuntimeError, ValueError) as e:
            raise ValueError(_reason(e)) from None
        return CompiledGrammar(NAME, self.vocab_size, lambda: XGrammarMatcher(compiled))


class XGrammarMatcher:
    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill(self, bitmask, row: int) -> None:
        """Row `row` of an int32 [rows, ceil(vocab / 32)] bitmask: bit t set where token t may come next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def _literal(text: str) -> str:
    """`text` as a regex matching itself (re.escape also escapes spaces, which xgrammar warns about)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def _reason(err: Exception) -> str:
    """xgrammar's message without its source location prefix ("[09:26:58] /project/cpp/x.cc:94: ...")."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text)
