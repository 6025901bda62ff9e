"""Incremental detokenization: text deltas that concatenate to exactly the final text.

A byte-level token may end inside a multi-byte character, and a token's leading space depends on what comes
before it; so each step decodes a short window of preceding tokens plus the new ones and emits only the text
past the window, holding back anything that ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        # A fast tokenizer's Rust decoder is what its `decode` calls when spaces are not cleaned up; called
        # directly it skips the Python wrapper, which cost more than the decoding (2 calls per token).
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            # Tokens before the prefix window are never decoded again.
            self.ids = self.ids[self.prefix_offset:]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (e.g. a truncated multi-byte character)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
