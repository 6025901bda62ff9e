"""N-gram (prompt lookup) proposer: if the last n tokens occurred earlier in the request, propose the tokens
that followed that earlier occurrence (longest n first, latest occurrence first)."""

from __future__ import annotations

import numpy as np

from pagedllm.engine.request import Request
from pagedllm.engine.spec_decode.proposer import Draft


class NgramProposer:
    """Arguments as validated by SpeculativeConfig."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Drafts for (request, limit) pairs; no draft distribution (the proposal is deterministic)."""
        found = {r.request_id: Draft(self.lookup(r.all_token_ids, limit)) for r, limit in wanted}
        return {rid: d for rid, d in found.items() if d.token_ids}

    def drop(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def lookup(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens continuing `token_ids`; [] when no n-gram matches."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        toks = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == toks[-n:]).all(axis=1))
            if hits.size:
                start = hits[-1] + n
                return toks[start:start + k].tolist()
        return []
