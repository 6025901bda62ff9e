"""The contract every draft proposer keeps."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from pagedllm.engine.request import Request


class Draft(NamedTuple):
    token_ids: list[int]
    # The draft distributions [len(token_ids), V] a sampled draft was drawn from (rejection sampling needs them);
    # None for a deterministic proposal (a point mass on each token).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Drafts for (request, most tokens wanted) pairs, by request id; a request may get none."""
        ...

    def drop(self, request_id: str) -> None:
        """Forget whatever is kept for a finished request."""
        ...
