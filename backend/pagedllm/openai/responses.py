"""OpenAI's response objects, built from the model's deltas: `text_completion` and `chat.completion` (whole),
their streamed chunks, usage and logprobs in OpenAI's shapes.

One object per request accumulates as the deltas arrive; a stream sends what `add` returns as it goes, a
non-streamed request asks for `result()` at the end. With n > 1 each delta names its choice (`index`), and
each choice has its own text, logprobs and finish reason. Usage is exact: prompt tokens are the model's
`num_input_tokens`, completion tokens the sum of its per-delta `num_output_tokens` over every choice.
"""

from __future__ import annotations

import time
import uuid

from pagedllm.openai.triton_bridge import Delta

# Logprobs of -inf (a token masked out) are not valid JSON numbers: sent as vLLM sends them.
_MIN_LOGPROB = -9999.0


class _Choice:
    """One choice's text, logprob entries (in the endpoint's shape) and finish reason so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.tokens: list[dict] = []
        self.finish_reason: str | None = None
        self.offset = 0  # completions: text_offset of the next token, from the completion's start (no echo)


class _Response:
    """The parts both endpoints share; `top_logprobs` None means logprobs were not asked for."""

    object_name = chunk_name = prefix = ""

    def __init__(self, model: str, top_logprobs: int | None = None, include_usage: bool = False,
                 n: int = 1) -> None:
        self.id = self.prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.k = top_logprobs
        self.include_usage = include_usage
        self.choices = [_Choice(i) for i in range(n)]
        self.prompt_tokens = self.completion_tokens = 0

    def add(self, delta: Delta) -> list[dict]:
        """Record a delta; the chunks to stream for it (its text, then a finishing chunk on its choice's last)."""
        if delta.num_input_tokens is not None:
            self.prompt_tokens = delta.num_input_tokens
        self.completion_tokens += delta.num_output_tokens
        choice = self.choices[delta.index]
        choice.text.append(delta.text)
        new = [self._token(choice, entry) for entry in delta.logprobs or ()] if self.k is not None else []
        choice.tokens.extend(new)
        chunks = [self._chunk(choice.index, delta.text, new)] if delta.text or new else []
        if delta.finish_reason:
            choice.finish_reason = delta.finish_reason
            chunks.append(self._finish_chunk(choice))
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

    def _token(self, choice: _Choice, entry: dict) -> dict:
        raise NotImplementedError

    def _chunk(self, index: int, text: str, tokens: list[dict]) -> dict:
        raise NotImplementedError

    def _finish_chunk(self, choice: _Choice) -> dict:
        raise NotImplementedError


class CompletionResponse(_Response):
    object_name = chunk_name = "text_completion"
    prefix = "cmpl-"

    def _token(self, choice: _Choice, entry: dict) -> dict:
        sampled, ranked = self._ranked(entry)
        token = sampled.get("decoded_token") or ""
        out = {"token": token, "logprob": _lp(sampled["logprob"]), "offset": choice.offset,
               # OpenAI's legacy shape: the top k and the sampled token, so up to k + 1 entries.
               "top": {}}
        for r in ranked:  # two tokens may decode to the same text: the likelier one keeps the key
            out["top"].setdefault(r.get("decoded_token") or "", _lp(r["logprob"]))
        choice.offset += len(token)
        return out

    @staticmethod
    def _logprobs(tokens: list[dict]) -> dict:
        return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": [t["top"] for t in tokens], "text_offset": [t["offset"] for t in tokens]}

    def _choice(self, index: int, text: str, tokens: list[dict] | None, finish: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None if tokens is None else self._logprobs(tokens),
                "finish_reason": finish}

    def _chunk(self, index: int, text: str, tokens: list[dict]) -> dict:
        logprobs = tokens if self.k is not None else None
        return {**self._stream_head(), "choices": [self._choice(index, text, logprobs, None)]}

    def _finish_chunk(self, choice: _Choice) -> dict:
        return {**self._stream_head(), "choices": [self._choice(choice.index, "", None, choice.finish_reason)]}

    def result(self) -> dict:
        return {**self._head(self.object_name),
                "choices": [self._choice(c.index, "".join(c.text), c.tokens if self.k is not None else None,
                                         c.finish_reason) for c in self.choices],
                "usage": self.usage()}


class ChatResponse(_Response):
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl-"

    def _token(self, choice: _Choice, entry: dict) -> dict:
        sampled, ranked = self._ranked(entry)
        top = [r for r in ranked if _rank(r) <= self.k]  # the entry holds the top k, plus the sampled token
        return {**_chat_token(sampled), "top_logprobs": [_chat_token(r) for r in top]}

    def _choice(self, index: int, delta: dict, tokens: list[dict] | None, finish: str | None) -> dict:
        return {"index": index, "delta": delta, "logprobs": None if tokens is None else {"content": tokens},
                "finish_reason": finish}

    def start_chunks(self) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [{**self._stream_head(), "choices": [self._choice(c.index, role, None, None)]} for c in self.choices]

    def _chunk(self, index: int, text: str, tokens: list[dict]) -> dict:
        return {**self._stream_head(),
                "choices": [self._choice(index, {"content": text}, tokens if self.k is not None else None, None)]}

    def _finish_chunk(self, choice: _Choice) -> dict:
        return {**self._stream_head(), "choices": [self._choice(choice.index, {}, None, choice.finish_reason)]}

    def result(self) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": None if self.k is None else {"content": c.tokens},
                    "finish_reason": c.finish_reason} for c in self.choices]
        return {**self._head(self.object_name), "choices": choices, "usage": self.usage()}


def _chat_token(record: dict) -> dict:
    token = record.get("decoded_token") or ""
    return {"token": token, "logprob": _lp(record["logprob"]), "bytes": list(token.encode("utf-8"))}


def _rank(record: dict) -> int:
    rank = record.get("rank")
    return rank if isinstance(rank, int) else 1 << 30  # 1 = the most likely token


def _lp(value) -> float:
    return max(float(value), _MIN_LOGPROB)
