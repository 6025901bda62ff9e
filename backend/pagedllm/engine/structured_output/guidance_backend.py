"""llguidance as a grammar backend: a spec compiles once into a matcher template; each request gets a copy.

llguidance lexes with derivative-based regular expressions and parses lexemes with an Earley parser, walking
the tokenizer's trie once per mask: 4-7 µs a row on a 32k vocabulary in every JSON state we timed one by one,
bounded integers included (xgrammar: 1-143 µs); 9-49 µs on average over whole runs (perf/README).

What it is given, and how it reads it:
- JSON schemas without free whitespace (compact: "," and ":" separators; with arbitrary whitespace allowed, a
  model may emit whitespace for ever inside a valid prefix). A schema's own "x-guidance" options (llguidance's
  extension) still apply. `true` is any JSON value; `false` is refused. A `format` llguidance does not check
  is dropped as the annotation JSON Schema makes it by default (Pydantic writes password, binary, path, ...);
  keywords it cannot enforce (uniqueItems, not, if, contains, ...) are refused by llguidance, naming them.
- Regexes with ASCII `\\d` and `\\w`, as xgrammar and JSON Schema's `pattern` read them (Rust's regex, which
  llguidance uses, would take any Unicode digit or letter).
- `grammar` as Lark or GBNF (llama.cpp's EBNF, as xgrammar's), told apart by llguidance.
"""

from __future__ import annotations

import json
import re

from pagedllm.engine.structured_output.request_grammar import CompiledGrammar

NAME = "guidance"
# The formats llguidance checks (others are dropped as annotations; llguidance would refuse them)
CHECKED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                             "uri"})
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


class GuidanceBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        """ValueError if llguidance cannot read the tokenizer (it needs a fast, `tokenizers`-backed one no larger
        than the model's vocabulary) or is not installed."""
        try:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                           eos_token=sorted(stop_token_ids) or None)
        except Exception as e:  # noqa: BLE001 - its errors are of several kinds; each means "not this tokenizer"
            raise ValueError(f"llguidance cannot use this tokenizer ({type(e).__name__}: {e})") from None
        self.vocab_size = vocab_size

    def compile(self, kind: str, value) -> CompiledGrammar:
        """ValueError with llguidance's reason for an invalid spec."""
        from llguidance import LLMatcher, grammar_from, regex_to_lark

        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(_schema(value), defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(value, 'dw')}/")
        elif kind == "choice":
            grammar = grammar_from("choice", json.dumps(list(value)))
        else:
            grammar = grammar_from("grammar", value)
        template = LLMatcher(self._tokenizer, grammar, log_level=0)  # builds the grammar; errors are its state
        if template.is_error():
            raise ValueError(_reason(template.get_error()))
        # a request's matcher is a copy of the template (~2 µs: the grammar is built once, in the template)
        return CompiledGrammar(NAME, self.vocab_size, lambda: GuidanceMatcher(template.deep_copy()))


class GuidanceMatcher:
    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill(self, bitmask, row: int) -> None:
        """Row `row` of an int32 [rows, ceil(vocab / 32)] bitmask (contiguous, on the CPU): bit t set where
        token t may come next (llguidance writes the whole row). ValueError if the matcher has failed (a
        resource limit mid-output): it would otherwise allow only EOS, ending the request as if complete."""
        width = bitmask.shape[1] * 4
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * width, width)
        if self._matcher.is_error():
            raise ValueError(f"structured output: {_reason(self._matcher.get_error())}")


def _schema(text: str) -> str:
    """The schema llguidance is given: `true` as {}, unchecked formats dropped (see the module's text)."""
    schema = json.loads(text)
    if schema is True:
        return "{}"
    if schema is False:
        raise ValueError("the schema false matches nothing")
    return json.dumps(_drop_unchecked_formats(schema))


def _drop_unchecked_formats(node):
    if isinstance(node, list):
        return [_drop_unchecked_formats(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: v if k in _DATA_KEYWORDS else _drop_unchecked_formats(v) for k, v in node.items()
            if not (k == "format" and isinstance(v, str) and v not in CHECKED_FORMATS)}


def _reason(text: str) -> str:
    """llguidance's message in one line: its first, without the position in the Lark text it wrapped the spec
    in ("at 1(8): "), completed by the "error: ..." line of a regex parser's excerpt."""
    lines = [line.strip() for line in text.strip().splitlines()] or ["invalid grammar"]
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    detail = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), None)
    return f"{first} {detail}" if first.endswith(":") and detail else first
