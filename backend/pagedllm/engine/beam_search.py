"""Beam search over paged sequences, with transformers' rules (generate(num_beams=W), do_sample=False).

Each live beam is a Request. A step computes every beam's next-token log-probs; the beams do not sample but
report their row here and wait (the scheduler skips a sequence with nothing to compute). Once all have
reported, the group chooses: the top 2W of (beam score + log-prob) over all beams (beam-major, as transformers
flattens them); candidates that end in EOS and rank among the first W become finished hypotheses scored
sum / generated_length ** length_penalty; the best W others continue. A beam chosen once continues in place,
one chosen again is forked (its blocks shared, the partly filled last one copied on its first write), one not
chosen is dropped and its blocks go back. It stops as transformers does: at max_tokens, when early_stopping is
True and W hypotheses are finished, or when no running beam can beat the worst finished one (its bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, an ending EOS included
    score: float  # sum_logprob / len ** length_penalty
    sum_logprob: float
    ended_by_eos: bool
    logprobs: list[tuple[float, int]]  # each token's logprob and rank


@dataclass
class Choice:
    parent: object  # the beam Request it extends
    token_id: int
    score: float  # its running sum of logprobs
    logprobs: list[tuple[float, int]]  # each token's logprob and rank, this one included


class BeamGroup:
    def __init__(self, request_id: str, params: SamplingParams, first_beam, eos_token_ids, decode) -> None:
        self.request_id = request_id
        self.params = params
        self.width = params.beam_width
        # A beam ends at EOS (unless ignore_eos) or at any of its stop token ids (TensorRT-LLM's end_id).
        self.eos = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width
        self.max_tokens = first_beam.max_tokens
        self.decode = decode  # token ids -> text
        self.beams: list = [first_beam]  # running, best first
        self.scores: list[float] = [0.0]
        self.logprobs: list[list[tuple[float, int]]] = [[]]  # per running beam
        self.finished: list[Hypothesis] = []  # at most W, best first
        self.reports: dict[str, torch.Tensor] = {}
        self.num_generated = 0
        self.done = False
        self.first_beam = first_beam  # its admission tells the prompt's prefix-cache hits

    def report(self, beam, logprobs: torch.Tensor) -> None:
        """A beam's next-token log-probs (fp32, [V]); a beam recomputed after preemption reports again."""
        self.reports[beam.request_id] = logprobs
        beam.waits_for_group = True

    @property
    def ready(self) -> bool:
        return not self.done and all(b.request_id in self.reports for b in self.beams)

    def choose(self) -> list[Choice]:
        """The next running beams (empty when the search is over; `done` is then set)."""
        rows = torch.stack([self.reports[b.request_id] for b in self.beams])
        self.reports.clear()
        for b in self.beams:
            b.waits_for_group = False
        vocab = rows.shape[1]
        cand = (rows + torch.tensor(self.scores, dtype=rows.dtype).unsqueeze(1)).flatten()
        values, flat = cand.topk(min(self.num_candidates, cand.numel()))
        length = self.num_generated + 1
        last = length >= self.max_tokens
        running: list[Choice] = []
        new_finished: list[Hypothesis] = []
        for rank, (value, index) in enumerate(zip(values.tolist(), flat.tolist())):
            b, token = divmod(index, vocab)
            beam, ends = self.beams[b], token in self.eos
            if not (ends or last or len(running) < self.width):
                continue
            if (ends or last) and rank >= self.width:
                continue  # only the first W candidates can finish (transformers' rule)
            lp = rows[b, token]
            logprobs = self.logprobs[b] + [(float(lp), int((rows[b] > lp).sum()) + 1)]
            if ends or last:
                new_finished.append(
                    Hypothesis(
                        beam.output_token_ids + [token],
                        value / length**self.params.length_penalty,
                        value,
                        ends,
                        logprobs,
                    )
                )
            else:
                running.append(Choice(beam, token, value, logprobs))
        # Stable sort: an earlier hypothesis wins a tie, as in transformers' merge (kept slots first).
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[: self.width]
        self.num_generated = length
        if last or not running or self._should_stop(running[0].score):
            self.done = True
            return []
        return running

    def _should_stop(self, best_running: float) -> bool:
        if len(self.finished) < self.width:
            return False
        if self.params.early_stopping is True:
            return True
        lp = self.params.length_penalty
        length = self.max_tokens if (self.params.early_stopping == "never" and lp > 0) else self.num_generated
        return not best_running / length**lp > min(h.score for h in self.finished)

    def continue_with(self, beams: list, choices: list[Choice]) -> None:
        """The beams `choose` picked, as the Requests that now carry them (in place or forked)."""
        self.beams = beams
        self.scores = [c.score for c in choices]
        self.logprobs = [c.logprobs for c in choices]

    def output(self, finish_reason: str | None = None) -> RequestOutput:
        """The result: the n best beams, best first (finished hypotheses; on abort, timeout or error, the
        running beams as they stand, with that reason)."""
        if finish_reason is None:
            hyps = [
                (h.token_ids, h.sum_logprob, h.logprobs, "stop" if h.ended_by_eos else "length")
                for h in self.finished
            ]
        else:
            hyps = [
                (list(b.output_token_ids), s, lps, finish_reason)
                for b, s, lps in zip(self.beams, self.scores, self.logprobs)
            ]
        outputs = [
            CompletionOutput(i, self.decode(tokens), tokens, total, self._entries(tokens, lps), reason)
            for i, (tokens, total, lps, reason) in enumerate(hyps[: self.params.n])
        ]
        first = self.first_beam
        return RequestOutput(self.request_id, first.prompt, list(first.prompt_token_ids), outputs, True,
                             first.num_cached_tokens, None, None)

    def _entries(self, tokens: list[int], logprobs: list[tuple[float, int]]):
        """The tokens' own logprobs, vLLM-shaped, when the request asked for them (logprobs=0)."""
        if self.params.logprobs is None:
            return None
        return [{t: Logprob(lp, rank, self.decode([t]))} for t, (lp, rank) in zip(tokens, logprobs)]
