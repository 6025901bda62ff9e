"""What each Triton response of one request carries, as plain numpy arrays (no Triton import).

Streaming requests run with DELTA outputs: every response carries the text (and counts the tokens) new since
the previous one; the prompt is never included. Non-streaming requests run with FINAL_ONLY outputs: a single
response with the whole text, prefixed by the prompt unless exclude_input_in_output (vllm_backend's
behaviour). Optional outputs follow the request's return_* flags.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from pagedllm.outputs import RequestOutput
from pagedllm.serving.request_parser import ParsedRequest


class ResponseBuilder:
    def __init__(self, parsed: ParsedRequest, num_input_tokens: int) -> None:
        self.parsed = parsed
        self.num_input_tokens = num_input_tokens

    def arrays_for(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """The output tensors to send for this engine output (a delta while streaming, else the final one)."""
        c = out.outputs[0]
        text = c.text
        if not self.parsed.stream and not self.parsed.exclude_input_in_output:
            text = self.parsed.prompt + text
        arrays = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
        wanted = self.parsed.returns
        if "finish_reason" in wanted:
            arrays["finish_reason"] = np.array([(c.finish_reason or "").encode()], dtype=np.object_)
        if "cumulative_logprob" in wanted:
            arrays["cumulative_logprob"] = np.array([c.cumulative_logprob or 0.0], dtype=np.float32)
        if "num_input_tokens" in wanted:
            arrays["num_input_tokens"] = np.array([self.num_input_tokens], dtype=np.uint32)
        if "num_output_tokens" in wanted:
            arrays["num_output_tokens"] = np.array([len(c.token_ids)], dtype=np.uint32)
        if "logprobs" in wanted:
            arrays["logprobs"] = np.array([_logprobs_json(c.logprobs)], dtype=np.object_)
        return arrays


def _logprobs_json(logprobs) -> bytes:
    if logprobs is None:
        return b"null"
    entries = [{str(tok): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for tok, lp in entry.items()} for entry in logprobs]
    return json.dumps(entries).encode()


def coalesce(items: list) -> list:
    """When the sender falls behind, several DELTA outputs of one request wait in the queue: merge them into one
    (text, tokens and logprobs joined, the newest state otherwise), so a busy server sends fewer, larger
    responses."""
    merged: dict[str, tuple] = {}
    for rid, out, err in items:
        prev = merged.get(rid)
        if prev is not None and prev[1] is not None and out is not None and prev[2] is None:
            a, b = prev[1].outputs[0], out.outputs[0]
            joined = dataclasses.replace(
                b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                logprobs=None if b.logprobs is None else (a.logprobs or []) + b.logprobs)
            out = dataclasses.replace(out, outputs=[joined])
        merged.pop(rid, None)  # re-insert: keep the newest item's position
        merged[rid] = (rid, out, err)
    return list(merged.values())
