"""What each Triton response of one request carries, as plain numpy arrays (no Triton import).

Streaming requests run with DELTA outputs: every response carries the text (and counts the tokens) new since
the previous one; the prompt is never included. Non-streaming requests run with FINAL_ONLY outputs: a single
response with the whole text, prefixed by the prompt unless exclude_input_in_output (vllm_backend's
behaviour). Optional outputs follow the request's return_* flags.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from pagedllm.outputs import RequestOutput
from pagedllm.serving.request_parser import ParsedRequest


class ResponseBuilder:
    def __init__(self, parsed: ParsedRequest, num_input_tokens: int, block_size: int = 16) -> None:
        self.parsed = parsed
        self.num_input_tokens = num_input_tokens
        self.block_size = block_size  # the engine's KV block size, for the KV-reuse outputs
        self.tokens_so_far = 0  # output tokens of every response so far (a stream's responses carry deltas)

    def arrays_for(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """The output tensors to send for this engine output (a delta while streaming, else the final one). The
        per-sequence outputs have one element per completion the output carries: one, or with n > 1 or beam
        search several, and then `sequence_index` says which sample or beam each element belongs to."""
        cs = out.outputs
        prefix = "" if self.parsed.stream or self.parsed.exclude_input_in_output else self.parsed.prompt
        arrays = {"text_output": np.array([(prefix + c.text).encode("utf-8") for c in cs], dtype=np.object_)}
        if self.parsed.params.num_sequences > 1:
            arrays["sequence_index"] = np.array([c.index for c in cs], dtype=np.uint32)
        wanted = self.parsed.returns
        if "finish_reason" in wanted:
            arrays["finish_reason"] = np.array([(c.finish_reason or "").encode() for c in cs], dtype=np.object_)
        if "cumulative_logprob" in wanted:
            arrays["cumulative_logprob"] = np.array([c.cumulative_logprob or 0.0 for c in cs], dtype=np.float32)
        if "num_input_tokens" in wanted:
            arrays["num_input_tokens"] = np.array([self.num_input_tokens], dtype=np.uint32)
        if "num_output_tokens" in wanted:
            arrays["num_output_tokens"] = np.array([len(c.token_ids) for c in cs], dtype=np.uint32)
        if "logprobs" in wanted:
            arrays["logprobs"] = np.array([_logprobs_json(c.logprobs) for c in cs], dtype=np.object_)
        self.tokens_so_far += sum(len(c.token_ids) for c in cs)
        # TensorRT-LLM's (return_log_probs): the cumulative logprob per sequence and this response's tokens'
        # logprobs, [sequences, tokens] (a shorter sequence's row padded with 0).
        if "cum_log_probs" in wanted:
            arrays["cum_log_probs"] = np.array([c.cumulative_logprob or 0.0 for c in cs], dtype=np.float32)
        if "output_log_probs" in wanted:
            rows = [[entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs or ())] for c in cs]
            table = np.zeros((len(rows), max(map(len, rows), default=0)), dtype=np.float32)
            for i, row in enumerate(rows):
                table[i, :len(row)] = row
            arrays["output_log_probs"] = table
        if "perf_metrics" in wanted:
            arrays.update(self._perf_metrics(out))
        if out.prompt_logprobs is not None:  # asked for with sampling_parameters' prompt_logprobs
            arrays["prompt_logprobs"] = np.array([_logprobs_json(out.prompt_logprobs)], dtype=np.object_)
        return arrays

    def _perf_metrics(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """TensorRT-LLM's return_perf_metrics outputs: KV blocks reused from the prefix cache, newly allocated
        and in all (for the tokens so far), the request's timestamps in ns since the epoch (0: not yet), and its
        speculative decoding counts (draft tokens verified, accepted, their ratio; 0 without speculation)."""
        total = -(-(self.num_input_tokens + self.tokens_so_far) // self.block_size)
        reused = min(out.num_cached_tokens // self.block_size, total)
        arrays = {"kv_cache_reused_blocks": np.array([reused], dtype=np.int32),
                  "kv_cache_alloc_new_blocks": np.array([total - reused], dtype=np.int32),
                  "kv_cache_alloc_total_blocks": np.array([total], dtype=np.int32)}
        m = out.metrics
        now_ns, now = time.time_ns(), time.monotonic()  # the metrics are monotonic times: moved to the epoch
        for name in ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time"):
            t = getattr(m, name) if m is not None else None
            arrays[name + "_ns"] = np.array([0 if t is None else now_ns - int((now - t) * 1e9)], dtype=np.int64)
        drafts, accepted = (m.num_draft_tokens, m.num_accepted_draft_tokens) if m else (0, 0)
        arrays["total_draft_tokens"] = np.array([drafts], dtype=np.int32)
        arrays["total_accepted_draft_tokens"] = np.array([accepted], dtype=np.int32)
        arrays["acceptance_rate"] = np.array([accepted / drafts if drafts else 0.0], dtype=np.float32)
        return arrays


def _logprobs_json(logprobs) -> bytes:
    if logprobs is None:
        return b"null"
    entries = [None if entry is None else {
        str(tok): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tok, lp in entry.items()} for entry in logprobs]
    return json.dumps(entries).encode()


def coalesce(items: list) -> list:
    """When the sender falls behind, several DELTA outputs of one request wait in the queue: merge them into one
    (each sequence's text, tokens and logprobs joined, the newest state otherwise), so a busy server sends
    fewer, larger responses."""
    merged: dict[str, tuple] = {}
    for rid, out, err in items:
        prev = merged.get(rid)
        if prev is not None and prev[1] is not None and out is not None and prev[2] is None:
            out = _join(prev[1], out)
        merged.pop(rid, None)  # re-insert: keep the newest item's position
        merged[rid] = (rid, out, err)
    return list(merged.values())


def _join(prev: RequestOutput, out: RequestOutput) -> RequestOutput:
    by_index = {c.index: c for c in prev.outputs}
    for b in out.outputs:
        a = by_index.get(b.index)
        by_index[b.index] = b if a is None else dataclasses.replace(
            b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
            logprobs=None if b.logprobs is None else (a.logprobs or []) + b.logprobs)
    return dataclasses.replace(out, outputs=[by_index[i] for i in sorted(by_index)],
                               # prompt logprobs come in a stream's first output
                               prompt_logprobs=prev.prompt_logprobs or out.prompt_logprobs)
