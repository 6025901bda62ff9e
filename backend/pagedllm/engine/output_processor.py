"""Per-request output state: detokenized text, stop strings, logprobs, and the deltas already handed out."""

from __future__ import annotations

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampler import SampledToken
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class RequestState:
    def __init__(self, req: Request, tokenizer) -> None:
        self.req = req
        self.tokenizer = tokenizer
        params = req.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, params.skip_special_tokens)
        self.text = ""
        self.stop = params.stop
        # While streaming, hold back text that could still turn out to be the start of a stop string.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.sent_text = 0
        self.sent_tokens = 0
        self.stopped_by_string = False

    def add_token(self, sampled: SampledToken, with_text: bool = True) -> RequestStatus | None:
        """Record the request's newest token; returns FINISHED_STOPPED if a stop string appeared."""
        req = self.req
        if req.logprobs is not None:
            req.cumulative_logprob += sampled.logprob
            req.logprobs.append(self._logprob_entry(sampled))
        if not with_text:
            return None
        delta = self.detok.add(sampled.token_id)
        if not delta:
            return None
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            idx, stop = min(hits)
            self.text = self.text[:idx]
            req.stop_reason = stop
            self.stopped_by_string = True
            return RequestStatus.FINISHED_STOPPED
        return None

    def _logprob_entry(self, s: SampledToken) -> dict[int, Logprob]:
        entry = {s.token_id: Logprob(s.logprob, s.rank, self.tokenizer.decode([s.token_id]))}
        for rank, (tok, lp) in enumerate(s.top_logprobs or (), start=1):
            entry.setdefault(tok, Logprob(lp, rank, self.tokenizer.decode([tok])))
        return entry

    def make_output(self) -> RequestOutput:
        """The request's output so far, with the delta since the previous call."""
        req = self.req
        finished = req.is_finished
        if finished and not self.stopped_by_string:
            self.text += self.detok.flush()
        visible = len(self.text) if finished else max(self.sent_text, len(self.text) - self.holdback)
        delta_text = self.text[self.sent_text:visible]
        delta_tokens = req.output_token_ids[self.sent_tokens:]
        self.sent_text, self.sent_tokens = visible, req.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=self.text[:visible],
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.last_token_time, req.finished_time)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished,
                             delta_text, delta_tokens, req.num_cached_tokens, metrics)
