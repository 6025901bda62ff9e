"""Token-level stop conditions (EOS, stop token ids, length). Stop strings are found by the detokenizer."""

from __future__ import annotations

from pagedllm.engine.request import Request, RequestStatus


def check_stop(req: Request, max_model_len: int) -> RequestStatus | None:
    """The status `req` must finish with after its newest token, or None to continue."""
    p = req.sampling_params
    last = req.output_token_ids[-1]
    if req.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and last in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in p.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
