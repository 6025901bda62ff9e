"""Token-level stop conditions (EOS, stop token ids, length). Stop strings are found by the detokenizer."""

from __future__ import annotations

from pagedllm.engine.request import Request, RequestStatus


def check_stop(req: Request, max_model_len: int, num_output: int | None = None) -> RequestStatus | None:
    """The status `req` must finish with after its output token number `num_output` (default: its newest;
    a speculative step appends several tokens and checks each in turn), or None to continue."""
    p = req.sampling_params
    n = req.num_output_tokens if num_output is None else num_output
    last = req.output_token_ids[n - 1]
    if n >= p.min_tokens:
        if not p.ignore_eos and last in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in p.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if n >= req.max_tokens or req.num_prompt_tokens + n >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
