"""Prompt logprobs (vLLM's `prompt_logprobs`): for each prompt position after the first, the logprob and rank
of the actual prompt token under the raw model distribution, plus the top k; the first entry is None.

The runner returns logits for every prompt position of such a request (step_inputs.PromptLogits says which
rows); the entries accumulate over prefill chunks. Position p's logits give token p + 1's entry, and an entry
is recorded only when it is the next one missing, so a request recomputed after preemption adds none twice.
"""

from __future__ import annotations

import torch

from pagedllm.engine.request import Request
from pagedllm.outputs import Logprob


@torch.inference_mode()
def record_prompt_logprobs(req: Request, logits: torch.Tensor, first_position: int, decode) -> None:
    """`logits` [n, V]: positions first_position .. first_position + n - 1 of `req`'s prompt. `decode`: token id
    -> text, or None (no text)."""
    entries = req.prompt_logprobs
    skip = len(entries) - 1 - first_position  # positions whose entries are already recorded
    if skip < 0:
        raise RuntimeError(f"prompt logprobs: position {first_position} computed before {len(entries) - 1}")
    logits = logits[skip:]
    start = first_position + skip
    if not logits.shape[0]:
        return
    lp = torch.log_softmax(logits.float().cpu(), dim=-1)
    actual = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + lp.shape[0]], dtype=torch.long)
    chosen = lp.gather(1, actual.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=1) + 1
    k = req.sampling_params.prompt_logprobs
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
    for row, tok in enumerate(actual.tolist()):
        entry = {tok: Logprob(float(chosen[row]), int(ranks[row]), decode(tok) if decode else None)}
        if k:
            for rank, (t, v) in enumerate(zip(top_ids[row].tolist(), top_vals[row].tolist()), start=1):
                entry.setdefault(t, Logprob(v, rank, decode(t) if decode else None))
        entries.append(entry)
