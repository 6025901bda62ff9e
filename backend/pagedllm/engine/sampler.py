"""Turns the logits of the rows that sample this step into tokens (and logprobs), one row per request.

Order of processing (as in vLLM): penalties, logit_bias / allowed_token_ids / bad_words, min_tokens masking, then greedy argmax, or temperature, top-k,
top-p, min-p and a draw. (A structured-output request's grammar mask is applied to its logits before, by the
engine: engine.structured_output.) A request with a seed draws from its own generator, so its tokens do not depend on
what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.engine.logits_controls import apply_token_controls
from pagedllm.engine.request import Request
from pagedllm.models.layers.fused import fused_for
from pagedllm.sampling_params import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    # The rest only for requests that asked for logprobs (None otherwise): under the raw model distribution.
    logprob: float | None
    rank: int | None
    top_logprobs: list[tuple[int, float]] | None


class Sampler:
    def __init__(self, seed: int, fused_ops=None) -> None:
        """`fused_ops`: the fused CPU ops module (layers.fused), whose argmax serves greedy bf16 CPU batches."""
        self.generator = torch.Generator().manual_seed(seed)
        self.fused_ops = fused_ops

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        simple = all(r.sampling_params.greedy and r.sampling_params.logprobs is None and
                     not r.sampling_params.needs_penalties and not r.sampling_params.min_tokens
                     and not r.sampling_params.has_token_controls for r in reqs)
        if simple:  # argmax in the logits' own dtype (fp32 conversion is exact: the same winner, the same ties)
            fused = fused_for(self.fused_ops, logits)
            ids = fused.argmax(logits) if fused is not None else logits.max(dim=-1).indices
            return [SampledToken(t, None, None, None) for t in ids.tolist()]
        logits = logits.float()
        if logits.device.type != "cpu":
            logits = logits.cpu()  # per-request generators and penalty bookkeeping live on the CPU
        # Logprobs come from the raw (unprocessed) distribution, and only for requests that asked for them.
        wants = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        raw = logits[wants].clone() if wants else None
        logits = self._apply_penalties_and_masks(logits, reqs)
        token_ids = logits.max(dim=-1).indices  # argmax's result; measured 3x faster on CPU
        random_rows = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows)
            token_ids[idx] = self._sample(logits[idx], [reqs[i] for i in random_rows])
        return self._logprobs(raw, wants, token_ids, reqs)

    def _apply_penalties_and_masks(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        for i, req in enumerate(reqs):
            p = req.sampling_params
            if p.needs_penalties:
                _apply_penalties(logits[i], req)
            if p.has_token_controls:
                apply_token_controls(logits[i], req)
            if req.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else req.eos_token_ids)
                if banned:
                    logits[i, list(banned)] = -float("inf")
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        probs = processed_probs(logits, [r.sampling_params for r in reqs])
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p. Unseeded rows share the engine's
        # generator; a seeded row draws from its own (`race`, as speculative verification draws it too).
        tokens = torch.empty(len(reqs), dtype=torch.long)
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            noise = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
            tokens[unseeded] = (probs[unseeded] / noise).argmax(dim=-1)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                tokens[i] = race(probs[i], r.generator)
        return tokens

    def _logprobs(self, raw: torch.Tensor | None, wants: list[int], token_ids: torch.Tensor,
                  reqs: list[Request]) -> list[SampledToken]:
        ids = token_ids.tolist()
        out = [SampledToken(t, None, None, None) for t in ids]
        if raw is None:
            return out
        logprobs = torch.log_softmax(raw, dim=-1)
        for row, i in enumerate(wants):
            lp = logprobs[row]
            chosen = lp[ids[i]]
            n = reqs[i].sampling_params.logprobs
            top = []
            if n:
                vals, top_ids = lp.topk(n)
                top = list(zip(top_ids.tolist(), vals.tolist()))
            out[i] = SampledToken(ids[i], float(chosen), int((lp > chosen).sum()) + 1, top)
        return out


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: the (unnormalised) distribution a non-greedy row is drawn from (one
    params per row)."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    logits = _top_k_top_p(logits / temps, [p.top_k for p in params], [p.top_p for p in params])
    probs = torch.softmax(logits, dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
    if (min_ps > 0).any():
        probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Normalised sampling distributions of one request at several positions ([n, V] logits)."""
    probs = processed_probs(logits.float(), [params] * logits.shape[0])
    return probs / probs.sum(dim=-1, keepdim=True)


def race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a row of (unnormalised) probabilities: argmax(p / E) with E ~ Exp(1), the generator's next V
    draws."""
    return int((probs / torch.empty_like(probs).exponential_(generator=generator)).argmax())


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.sampling_params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=row.shape[0])[: row.shape[0]]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    if not any(top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks]).unsqueeze(1)
    mask = torch.arange(vocab).unsqueeze(0) >= ks
    probs = torch.softmax(sorted_logits.masked_fill(mask, -float("inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
    top_p = torch.tensor(top_ps).unsqueeze(1)
    # The first token is always kept (before == 0); a row without top-p keeps its tail even where the float
    # running sum rounds to 1 (so its draws do not depend on a top-p row beside it in the batch).
    mask |= (before >= top_p) & (top_p < 1.0)
    sorted_logits = sorted_logits.masked_fill(mask, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
