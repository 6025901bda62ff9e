"""llguidance as a grammar backend: a spec compiles once into a matcher template; each request gets a copy.

llguidance lexes with derivative-based regular expressions and parses lexemes with an Earley parser, walking
the tokenizer's trie once per mask: ~5 µs per row on a 32k vocabulary in every JSON state we measured,
bounded integers included (xgrammar: 1-140 µs), see perf/structured_output.py. JSON is compiled without free
whitespace (compact: "," and ":" separators); with arbitrary whitespace allowed, a model may emit whitespace
for ever inside a valid prefix. `grammar` takes Lark or GBNF (llama.cpp's EBNF, as xgrammar's), told apart
by llguidance.
"""

from __future__ import annotations

import json
import re

NAME = "guidance"


class GuidanceBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        """ValueError if llguidance cannot read the tokenizer (it needs a fast, `tokenizers`-backed one)."""
        import llguidance.hf

        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                           eos_token=sorted(stop_token_ids) or None)
        except Exception as e:  # noqa: BLE001 - its errors are of several kinds; each means "not this tokenizer"
            raise ValueError(f"llguidance cannot use this tokenizer ({type(e).__name__}: {e})") from None
        self.vocab_size = vocab_size

    def compile(self, kind: str, value) -> GuidanceGrammar:
        """ValueError with llguidance's reason for an invalid spec."""
        from llguidance import LLMatcher, grammar_from

        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            grammar = grammar_from("choice", json.dumps(list(value)))
        else:
            grammar = grammar_from("grammar", value)
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(_reason(error))
        template = LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(_reason(template.get_error()))
        return GuidanceGrammar(template, self.vocab_size)


class GuidanceGrammar:
    backend = NAME

    def __init__(self, template, vocab_size: int) -> None:
        self.template, self.vocab_size = template, vocab_size

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self.template.deep_copy())  # ~2 µs: the grammar is built once, in the template


class GuidanceMatcher:
    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill(self, bitmask, row: int) -> None:
        """Row `row` of an int32 [rows, ceil(vocab / 32)] bitmask (contiguous, on the CPU): bit t set where
        token t may come next (llguidance writes the whole row)."""
        width = bitmask.shape[1] * 4
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * width, width)


def _reason(text: str) -> str:
    """llguidance's message in one line: its first, without the position in the Lark text it wrapped the spec
    in ("at 1(8): "), completed by the "error: ..." line of a regex parser's excerpt."""
    lines = [line.strip() for line in text.strip().splitlines()] or ["invalid grammar"]
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    detail = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), None)
    return f"{first} {detail}" if first.endswith(":") and detail else first
