"""`n` and `best_of`: one request runs as several sample sequences that share its prompt's KV.

Sample 0 is queued like any request; the others wait beside it. The step whose logits give sample 0 its first
token samples the others from the same logits row (each with its own generator: seed + i, as vLLM derives
them), and they fork from sample 0: they take references on its blocks rather than prefilling the prompt
again, and the KV manager copies the last, partly filled block for each one that writes into it. From then on
every sample is an ordinary request. The group merges the samples' outputs into the caller's one request.
"""

from __future__ import annotations

import dataclasses

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """Each sample's parameters: one sequence, seed + i. Samples ranked for best_of compute their tokens'
    logprobs (their cumulative logprob is the ranking); only sample 0 records prompt logprobs."""
    count = params.best_of or params.n
    ranked = count > params.n
    return [
        dataclasses.replace(
            params,
            n=1,
            best_of=None,
            seed=None if params.seed is None else (params.seed + i) % 2**64,
            logprobs=0 if ranked and params.logprobs is None else params.logprobs,
            prompt_logprobs=params.prompt_logprobs if i == 0 else None,
        )
        for i in range(count)
    ]


class SampleGroup:
    def __init__(self, request_id: str, params: SamplingParams, samples: list) -> None:
        self.request_id = request_id
        self.params = params  # the caller's: n, best_of, output kind, logprobs
        self.samples = samples  # Requests; sample i is index i
        self.index = {r.request_id: i for i, r in enumerate(samples)}
        self.pending = samples[1:]  # not forked yet: sampled beside sample 0's first token
        self.finals: dict[int, CompletionOutput] = {}
        self.latest: dict[int, CompletionOutput] = {}
        self.head: RequestOutput | None = None  # sample 0's latest output: prompt, prompt logprobs, metrics
        self.error: str | None = None  # the first sample's failure, if one failed

    def siblings_to_sample(self, req) -> list:
        """The samples to draw beside `req`'s row this step: the pending ones, at sample 0's first token."""
        if self.pending and req is self.samples[0] and req.num_output_tokens == 0:
            return self.pending
        return []

    def forked(self) -> None:
        self.pending = []
        self.samples[0].seqs_to_reserve = 1

    def merge(self, out: RequestOutput) -> RequestOutput | None:
        """The caller's output for one sample's output, per the caller's output kind: every sample's delta as it
        comes (its `index` says whose), every sample so far, or all samples once every one has finished. Under
        best_of > n the last two hold the n best (by cumulative logprob so far), and `index` is then a rank: from
        one cumulative output to the next it may name another sample."""
        i = self.index[out.request_id]
        c = dataclasses.replace(out.outputs[0], index=i)
        if self.params.logprobs is None:  # computed for ranking only
            c.logprobs = None
        if i == 0:
            self.head = out
        self.error = self.error or out.error
        if out.finished:
            self.finals[i] = c
        self.latest[i] = c
        done = len(self.finals) == len(self.samples)
        kind = self.params.output_kind
        if kind == RequestOutputKind.DELTA:
            return self._output([c], done, out)
        if kind == RequestOutputKind.CUMULATIVE:
            return self._output(self._top(self.latest), done, out)
        return self._output(self._top(self.finals), True, out) if done else None

    def _top(self, completions: dict[int, CompletionOutput]) -> list[CompletionOutput]:
        """The samples in order; of best_of > n, the n with the highest cumulative logprob so far, best first (a
        cumulative output never holds more than n, and its last one the n a final-only output holds)."""
        ordered = [completions[k] for k in sorted(completions)]
        if len(self.samples) == self.params.n:
            return ordered
        ranked = sorted(
            ordered,
            key=lambda c: -(c.cumulative_logprob if c.cumulative_logprob is not None else float("-inf")),
        )[: self.params.n]
        return [dataclasses.replace(c, index=k) for k, c in enumerate(ranked)]

    def _output(
        self, completions: list[CompletionOutput], finished: bool, out: RequestOutput
    ) -> RequestOutput:
        head = self.head or out
        # A DELTA stream hands prompt logprobs out once, with sample 0's first output (as it has them).
        once = self.params.output_kind == RequestOutputKind.DELTA and head is not out
        return RequestOutput(
            self.request_id,
            head.prompt,
            head.prompt_token_ids,
            completions,
            finished,
            head.num_cached_tokens,
            head.metrics,
            self.error if finished else out.error,
            None if once else head.prompt_logprobs,
        )
