"""Acceptance counters for speculative decoding (vLLM's spec_decode_* numbers)."""

from __future__ import annotations


class SpecDecodeStats:
    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []  # [i]: drafts accepted at position i

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def fields(self) -> dict:
        """The EngineStats fields these counters fill."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_accepted_per_position": list(self.accepted_per_position)}
