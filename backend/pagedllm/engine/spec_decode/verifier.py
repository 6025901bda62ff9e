"""Verification of draft tokens against the target model's distributions at the k+1 drafted positions.

Greedy: drafts are accepted while they equal the target's argmax; the first mismatch is replaced by the
argmax (or, all accepted, the argmax after the last draft is added). Sampling: standard rejection sampling,
so the emitted tokens are distributed exactly as the target's: draft d_i with draft probability q_i(d_i) is
accepted with probability min(1, p_i(d_i) / q_i(d_i)); on rejection the token is drawn from
normalize(max(p_i - q_i, 0)) and verification stops. The n-gram proposer is deterministic, so q_i is a point
mass on d_i: acceptance probability p_i(d_i), and the residual is p_i without d_i.
"""

from __future__ import annotations

import torch

from pagedllm.engine.request import Request
from pagedllm.engine.sampler import target_probs


def verify(logits: torch.Tensor, drafts: list[int], req: Request, generator: torch.Generator,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """logits [k+1, V] at the positions of the last computed token and the k drafts. Returns the emitted
    tokens: the accepted drafts, then one token from the target (so 1 to k+1 tokens)."""
    params = req.sampling_params
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if best[i] != d:
                return out + [best[i]]
            out.append(d)
        return out + [best[len(drafts)]]
    probs = target_probs(logits, params)  # [k+1, V], the distribution the plain sampler draws from
    g = req.generator or generator
    out = []
    for i, d in enumerate(drafts):
        p = probs[i]
        q = draft_probs[i] if draft_probs is not None else None
        accept = p[d] if q is None else torch.clamp(p[d] / q[d], max=1.0)
        if torch.rand((), generator=g) < accept:
            out.append(d)
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        if residual.sum() <= 0:  # p was a point mass on d after all (numerically): keep d
            return out + [d]
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=g))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=g))]
