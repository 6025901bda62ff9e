"""OpenAI's response objects, built from the model's deltas: `text_completion` and `chat.completion` (whole),
their streamed chunks, usage and logprobs in OpenAI's shapes.

One object per request accumulates as the deltas arrive; a stream sends what `add` returns as it goes, a
non-streamed request asks for `result()` at the end. Usage is exact: prompt tokens are the model's
`num_input_tokens`, completion tokens the sum of its per-delta `num_output_tokens`.
"""

from __future__ import annotations

import time
import uuid

from pagedllm.openai.triton_bridge import Delta

# Logprobs of -inf (a token masked out) are not valid JSON numbers: sent as vLLM sends them.
_MIN_LOGPROB = -9999.0


class _Response:
    """The parts both endpoints share; `top_logprobs` None means logprobs were not asked for."""

    object_name = chunk_name = prefix = ""

    def __init__(self, model: str, top_logprobs: int | None = None, include_usage: bool = False) -> None:
        self.id = self.prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.k = top_logprobs
        self.include_usage = include_usage
        self.text: list[str] = []
        self.tokens: list[dict] = []  # one logprob entry per generated token, in this endpoint's shape
        self.prompt_tokens = self.completion_tokens = 0
        self.finish_reason: str | None = None

    def add(self, delta: Delta) -> list[dict]:
        """Record a delta; the chunks to stream for it (its text, then a finishing chunk on the last)."""
        if delta.num_input_tokens is not None:
            self.prompt_tokens = delta.num_input_tokens
        self.completion_tokens += delta.num_output_tokens
        self.text.append(delta.text)
        new = [self._token(entry) for entry in delta.logprobs or ()] if self.k is not None else []
        self.tokens.extend(new)
        chunks = [self._chunk(delta.text, new)] if delta.text or new else []
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            chunks.append(self._finish_chunk())
        return chunks

    def start_chunks(self) -> list[dict]:
        return []

    def end_chunks(self) -> list[dict]:
        """With stream_options.include_usage: a last chunk with no choices and the usage."""
        if not self.include_usage:
            return []
        return [{**self._head(self.chunk_name), "choices": [], "usage": self.usage()}]

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _stream_head(self) -> dict:
        # OpenAI: with include_usage, every chunk but the last carries "usage": null.
        return {**self._head(self.chunk_name), **({"usage": None} if self.include_usage else {})}

    @staticmethod
    def _ranked(entry: dict) -> tuple[dict, list[dict]]:
        """(the sampled token's record, all records by rank): the entry's first key is the sampled token."""
        records = list(entry.values())
        return records[0], sorted(records, key=_rank)

    def _token(self, entry: dict) -> dict:
        raise NotImplementedError

    def _chunk(self, text: str, tokens: list[dict]) -> dict:
        raise NotImplementedError

    def _finish_chunk(self) -> dict:
        raise NotImplementedError


class CompletionResponse(_Response):
    object_name = chunk_name = "text_completion"
    prefix = "cmpl-"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offset = 0  # text_offset of the next token, from the completion's start (no echo)

    def _token(self, entry: dict) -> dict:
        sampled, ranked = self._ranked(entry)
        token = sampled.get("decoded_token") or ""
        out = {"token": token, "logprob": _lp(sampled["logprob"]), "offset": self.offset,
               # OpenAI's legacy shape: the top k and the sampled token, so up to k + 1 entries.
               "top": {}}
        for r in ranked:  # two tokens may decode to the same text: the likelier one keeps the key
            out["top"].setdefault(r.get("decoded_token") or "", _lp(r["logprob"]))
        self.offset += len(token)
        return out

    @staticmethod
    def _logprobs(tokens: list[dict]) -> dict:
        return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": [t["top"] for t in tokens], "text_offset": [t["offset"] for t in tokens]}

    def _choice(self, text: str, tokens: list[dict] | None, finish: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None if tokens is None else self._logprobs(tokens),
                "finish_reason": finish}

    def _chunk(self, text: str, tokens: list[dict]) -> dict:
        logprobs = tokens if self.k is not None else None
        return {**self._stream_head(), "choices": [self._choice(text, logprobs, None)]}

    def _finish_chunk(self) -> dict:
        return {**self._stream_head(), "choices": [self._choice("", None, self.finish_reason)]}

    def result(self) -> dict:
        tokens = self.tokens if self.k is not None else None
        return {**self._head(self.object_name), "choices": [self._choice("".join(self.text), tokens,
                                                                         self.finish_reason)],
                "usage": self.usage()}


class ChatResponse(_Response):
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl-"

    def _token(self, entry: dict) -> dict:
        sampled, ranked = self._ranked(entry)
        top = [r for r in ranked if _rank(r) <= self.k]  # the entry holds the top k, plus the sampled token
        return {**_chat_token(sampled), "top_logprobs": [_chat_token(r) for r in top]}

    def _choice(self, delta: dict, tokens: list[dict] | None, finish: str | None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None if tokens is None else {"content": tokens},
                "finish_reason": finish}

    def start_chunks(self) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [{**self._stream_head(), "choices": [self._choice(role, None, None)]}]

    def _chunk(self, text: str, tokens: list[dict]) -> dict:
        return {**self._stream_head(),
                "choices": [self._choice({"content": text}, tokens if self.k is not None else None, None)]}

    def _finish_chunk(self) -> dict:
        return {**self._stream_head(), "choices": [self._choice({}, None, self.finish_reason)]}

    def result(self) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(self.text)},
                  "logprobs": None if self.k is None else {"content": self.tokens},
                  "finish_reason": self.finish_reason}
        return {**self._head(self.object_name), "choices": [choice], "usage": self.usage()}


def _chat_token(record: dict) -> dict:
    token = record.get("decoded_token") or ""
    return {"token": token, "logprob": _lp(record["logprob"]), "bytes": list(token.encode("utf-8"))}


def _rank(record: dict) -> int:
    rank = record.get("rank")
    return rank if isinstance(rank, int) else 1 << 30  # 1 = the most likely token


def _lp(value) -> float:
    return max(float(value), _MIN_LOGPROB)
