"""The one place that decides when a request is finished and what its outputs are.

For each token a step appends to a request (several with speculation) it checks the token-level stops (EOS,
stop token ids, length), records logprobs, detokenizes and looks for stop strings; on a stop it drops the
tokens after it and reports the finish status (the engine then tells the scheduler, which frees the blocks).
Outputs are built here too, per the request's output kind, as snapshots no other thread can see change.
"""

from __future__ import annotations

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampler import SampledToken
from pagedllm.engine.stop_checker import check_stop
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class RequestState:
    """A live request's text, logprobs and what its earlier outputs already handed out."""

    def __init__(self, req: Request, tokenizer, stream_interval: int = 1) -> None:
        self.req = req
        self.tokenizer = tokenizer
        params = req.sampling_params
        self.kind = params.output_kind
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, params.skip_special_tokens)
        self.text = ""
        self.stop = params.stop
        # Text that could still turn out to be the start of a stop string is not handed out yet.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.sent_text = 0  # characters handed out in earlier DELTA outputs
        # Output tokens (and their logprob entries) handed out by the last output of any kind; 0: none yet.
        self.sent_tokens = 0
        self.sent_prompt_logprobs = False  # a DELTA output hands them out once, in the first output
        self.stopped_by_string = False
        self.detokenize = params.detokenize  # False: token ids only, the text stays empty (vLLM's)
        # Outputs before the end come every `interval` tokens, the first at once (vLLM's stream interval).
        self.interval = max(stream_interval, params.stream_interval or 1)

    def add_token(self, sampled: SampledToken, with_text: bool) -> bool:
        """Record the request's newest token; True if a stop string appeared (the text is cut before it)."""
        if self.logprobs is not None:
            self.cumulative_logprob += sampled.logprob
            self.logprobs.append(self._logprob_entry(sampled))
        if not with_text or not self.detokenize:
            return False
        delta = self.detok.add(sampled.token_id)
        if not delta:
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        self.text = self.text[:idx + (len(stop) if self.req.sampling_params.include_stop_str_in_output else 0)]
        self.req.stop_reason = stop
        self.stopped_by_string = True
        return True

    def _logprob_entry(self, s: SampledToken) -> dict[int, Logprob]:
        decode = (lambda t: self.tokenizer.decode([t])) if self.detokenize else (lambda t: None)
        entry = {s.token_id: Logprob(s.logprob, s.rank, decode(s.token_id))}
        for rank, (tok, lp) in enumerate(s.top_logprobs or (), start=1):
            entry.setdefault(tok, Logprob(lp, rank, decode(tok)))
        return entry

    def output(self) -> RequestOutput | None:
        """What this request hands out now, per its kind; None when nothing is due (FINAL_ONLY before the end,
        fewer tokens than its stream interval since the last output, or a DELTA with nothing new)."""
        req = self.req
        finished = req.is_finished
        if finished and not self.stopped_by_string and self.detokenize:
            self.text += self.detok.flush()
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if not finished and self.interval > 1 and self.sent_tokens \
                and req.num_output_tokens - self.sent_tokens < self.interval:
            return None
        visible = len(self.text) if finished else max(self.sent_text, len(self.text) - self.holdback)
        if self.kind == RequestOutputKind.DELTA:
            # Nothing new to hand out: no visible text (a token's bytes may end mid-character), or without
            # text no new token.
            if self.detokenize:
                nothing_new = visible == self.sent_text
            else:
                nothing_new = req.num_output_tokens == self.sent_tokens
            if nothing_new and not finished:
                return None
            text, tokens = self.text[self.sent_text:visible], req.output_token_ids[self.sent_tokens:]
            logprobs = None if self.logprobs is None else self.logprobs[self.sent_tokens:]
            self.sent_text = visible
        else:
            text, tokens = self.text[:visible], list(req.output_token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self.sent_tokens = req.num_output_tokens
        completion = CompletionOutput(
            index=0, text=text, token_ids=tokens,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=logprobs, finish_reason=req.status.finish_reason, stop_reason=req.stop_reason)
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.last_token_time, req.finished_time, req.num_draft_tokens,
                                 req.num_accepted_draft_tokens)
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt_logprobs = list(req.prompt_logprobs)
            self.sent_prompt_logprobs = self.kind == RequestOutputKind.DELTA
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished,
                             req.num_cached_tokens, metrics, req.error, prompt_logprobs)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval  # the engine's: the least any request gets
        self.states: dict[str, RequestState] = {}

    def add_request(self, req: Request) -> None:
        self.states[req.request_id] = RequestState(req, self.tokenizer, self.stream_interval)

    def process_tokens(self, req: Request, tokens: list[SampledToken]) -> RequestStatus | None:
        """`tokens` were just appended to `req`. Check each in turn; on a stop, drop the ones after it and return
        the status the request must finish with. None: it goes on."""
        state = self.states[req.request_id]
        before = req.num_output_tokens - len(tokens)
        for j, token in enumerate(tokens):
            n = before + j + 1
            if req.grammar is not None:  # a token the grammar refuses fails this request alone
                req.grammar.accept(token.token_id)
            status = check_stop(req, self.max_model_len, n)
            # An EOS or stop token ends the request without adding its text (as vLLM does).
            stopped_by_token = status == RequestStatus.FINISHED_STOPPED
            if state.add_token(token, with_text=not stopped_by_token):
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                req.truncate_output(n)
                return status
        return None

    def output(self, req: Request) -> RequestOutput | None:
        """The output a live request hands out after this step, if any."""
        return self.states[req.request_id].output()

    def finish(self, req: Request) -> RequestOutput:
        """The final output of a finished request (stopped, aborted, timed out, failed); its state is dropped.
        If building it fails (its text, say), the request still ends: with an error and no text."""
        state = self.states.pop(req.request_id)
        try:
            return state.output()
        except Exception as e:
            req.error = req.error or f"{type(e).__name__}: {e}"
            completion = CompletionOutput(0, "", list(req.output_token_ids), None, None, "error", None)
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], True,
                                 req.num_cached_tokens, None, req.error)
