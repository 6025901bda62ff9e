"""Verification of draft tokens against the target model's distributions at the k+1 drafted positions.

Greedy: drafts are accepted while they equal the target's argmax; the first mismatch is replaced by the argmax
(or, all accepted, the argmax after the last draft is added).

Sampling with drafts that are point masses (the n-gram proposer's): position by position the target draws its
own token exactly as the plain sampler would (the same exponential race, from the same generator), and a draft
is accepted while it is that token; the first other token is emitted and verification stops. A draft d_i is thus
accepted with probability p_i(d_i), as rejection sampling would accept it, the emitted tokens are distributed
exactly as the target's, and a seeded request draws one noise row per emitted token: its tokens are those it
gets without speculation, however many drafts each step held (the token budget trims them).

A draft model's drafts (sampled with the request's parameters, draft probabilities q_i): standard rejection
sampling, so a seeded request's tokens there depend on the drafts. Draft d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); on rejection the token is drawn from normalize(max(p_i - q_i, 0)) and verification
stops.
"""

from __future__ import annotations

import torch

from pagedllm.engine.request import Request
from pagedllm.engine.sampler import processed_probs, race, target_probs


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
    g = req.generator or generator
    out = []
    if draft_probs is None:
        probs = processed_probs(logits.float(), [params] * logits.shape[0])  # as the plain sampler's rows
        for i in range(len(drafts) + 1):
            token = race(probs[i], g)
            if i == len(drafts) or token != drafts[i]:
                return out + [token]
            out.append(token)
    probs = target_probs(logits, params)  # [k+1, V], normalised
    for i, d in enumerate(drafts):
        p, q = probs[i], draft_probs[i]
        if torch.rand((), generator=g) < torch.clamp(p[d] / q[d], max=1.0):
            out.append(d)
            continue
        residual = torch.clamp(p - q, min=0.0)
        if residual.sum() <= 0:  # p was q after all (numerically): keep d
            return out + [d]
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=g))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=g))]
