"""The wire to Triton: each request a POST to Triton's `generate_stream` endpoint (its generate extension), read
as Server-Sent Events with aiohttp, over a pool of kept-alive connections.

Why HTTP and not a gRPC stream: per streamed token, grpc.aio's client spends most of this process's time in its
poller thread and the hand-off to the event loop (measured at 64 streams: 0.19 of a core for the front end over
gRPC; perf/README, session 41). The front end shares the host's cores with the engine, so what it spends per
token the engine loses (about twice over, beside OpenMP threads); an SSE event costs a read and a `json.loads`.

Every request runs with `stream` on (DELTA outputs), streamed to the HTTP client or not: one code path, and a
non-streamed request is just the deltas joined (except a completion with best_of > n, whose best samples are
known only at the end: the model sends it as one final response, read the same way). The request's end is the
end of Triton's response body (a chunked body cut short is an error, not an end). An error before the first
event comes as a non-200 status with `{"error": ...}`, one after it as an event `{"error": ...}`; the model sends
each error as its request's final response. Leaving the generator early, by an exception, a cancellation (the
HTTP client went away) or `aclose()`, closes the connection (a request read to its end leaves it to the pool
instead); Triton notices at its next write to it, cancels the request, and the model aborts it and frees its KV
blocks. Every request asks for the model's `heartbeat` (an empty event after each 0.5 s without one), so that
next write comes soon even for a request that is queued, prefilling or final-only (docs/RELIABILITY.md,
"Disconnects").
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from pagedllm.openai import triton_errors
from pagedllm.openai.protocol import OpenAIError

logger = logging.getLogger(__name__)


@dataclass
class Delta:
    """What one model response adds."""

    text: str
    num_output_tokens: int  # tokens in this delta
    num_input_tokens: int | None = None
    finish_reason: str | None = None  # set on the last: "stop", "length" (or "timeout")
    # One entry per new token: {token_id: {"logprob", "rank", "decoded_token"}}, the sampled token first.
    logprobs: list[dict] | None = None
    index: int = 0  # the choice (sample) it belongs to, with n > 1


class TritonBridge:
    def __init__(self, url: str, model_name: str = "pagedllm") -> None:
        # An aiohttp session belongs to the event loop it is made in: make the bridge inside the server's loop.
        base = url if "://" in url else f"http://{url}"
        self.generate_url = f"{base}/v2/models/{model_name}/generate_stream"
        self.ready_url = f"{base}/v2/models/{model_name}/ready"
        # No pool limit (each stream holds its connection while it runs), connections kept alive between requests
        # (Triton keeps them: a new connection per request cost 2-3 ms of its TTFT at 8 streams, up to 20 ms in
        # the tail), no read timeout (a request may wait in the model's queue); connecting is quick or Triton is
        # not there.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None))

    async def is_ready(self) -> bool:
        try:
            async with self.session.get(self.ready_url) as resp:
                return resp.status == 200
        except aiohttp.ClientConnectorError:  # Triton unreachable: not ready either
            return False
        except aiohttp.ClientError as e:  # something answered, but not in HTTP/1.1: Triton's gRPC port, say
            logger.warning("%s did not answer as Triton's HTTP endpoint (%s: %s); --triton-url takes its HTTP "
                           "port", self.ready_url, type(e).__name__, e)
            return False

    async def close(self) -> None:
        await self.session.close()

    async def generate(self, sampling: dict, params: dict[str, str], *,
                       prompt: str | None = None, messages: list | None = None,
                       logprobs: bool = False, deltas: bool = True) -> AsyncIterator[Delta]:
        """The request's deltas, in order; raises OpenAIError (`params` names request fields in its `param`).
        Consume it inside `contextlib.aclosing` so that leaving early cancels the request at once. `deltas`
        False asks the model for one final response instead (best_of > n can only answer at the end)."""
        body = _body(sampling, prompt, messages, logprobs, deltas)
        try:
            async with self.session.post(self.generate_url, data=body,
                                         headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    raise triton_errors.from_stream_message(_message(await resp.text()), params)
                try:
                    async for event in _events(resp.content):
                        if "error" in event:
                            raise triton_errors.from_stream_message(event["error"], params)
                        for delta in deltas_of(event):
                            yield delta
                finally:
                    # Read to its end, the response has already handed its connection back to the pool (this
                    # does nothing then); left early, closing the connection is what cancels the request.
                    resp.close()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise OpenAIError(503, f"Triton: unreachable: {e}") from None
        except aiohttp.ClientError as e:  # the connection broke mid-response (Triton gone)
            raise OpenAIError(502, f"Triton: the response broke off: {type(e).__name__}: {e}") from None


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[dict]:
    """The body's `data:` events, each a JSON object. Read in whatever pieces arrive and cut at the blank lines
    between events, not line by line: aiohttp's readline refuses lines over 2 x its read buffer, and one event
    (a final-only completion with logprobs, say) can be megabytes."""
    pending = bytearray()
    async for piece in content.iter_any():
        pending += piece
        while (end := pending.find(b"\n\n")) >= 0:
            raw = bytes(pending[:end])
            del pending[:end + 2]
            for line in raw.split(b"\n"):
                if line.startswith(b"data:"):
                    try:
                        yield json.loads(line[5:])
                    except ValueError:
                        raise OpenAIError(502, f"Triton: an event that is not JSON: {line[:200]!r}") from None


def request_inputs(sampling: dict, prompt: str | None, messages: list | None, logprobs: bool,
                   stream: bool) -> dict:
    """The model's inputs for one OpenAI request, by name (as the generate endpoint and the engine channel take
    them)."""
    # Exactly one of text_input / messages: the model renders messages with its chat template.
    inputs = {"stream": stream, "sampling_parameters": json.dumps(sampling),
              "exclude_input_in_output": True,  # OpenAI never repeats the prompt (echo is refused)
              "return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True}
    if messages is not None:
        inputs["messages"] = json.dumps(messages)
    else:
        inputs["text_input"] = prompt
    if logprobs:
        inputs["return_logprobs"] = True
    return inputs


def _body(sampling: dict, prompt: str | None, messages: list | None, logprobs: bool,
          stream: bool) -> bytes:
    # An empty response from the model after each half second without one: Triton notices that this
    # connection closed only when it writes to it (a request queued, prefilling, or final-only).
    return json.dumps({**request_inputs(sampling, prompt, messages, logprobs, stream), "heartbeat": True}).encode()


def _message(text: str) -> str:
    """The message of an error body: `data: {"error": ...}` (the streaming endpoint's form) or plain JSON."""
    text = text.strip().removeprefix("data:")
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return text


def deltas_of(event: dict) -> list[Delta]:
    """One event's deltas, one per sequence it carries. Triton writes an output of one element as a scalar and
    one of several (a response carrying several samples) as a list."""
    texts = _each(event.get("text_output"))
    reasons, n_outs, lps, index = (_each(event.get(k)) for k in ("finish_reason", "num_output_tokens", "logprobs",
                                                                 "sequence_index"))
    n_in = event.get("num_input_tokens")
    return [Delta(text=text, num_output_tokens=int(n_outs[i]) if n_outs else 0,
                  num_input_tokens=int(n_in) if n_in is not None and i == 0 else None,
                  finish_reason=reasons[i] or None if reasons else None,
                  logprobs=json.loads(lps[i]) if lps else None,
                  index=int(index[i]) if index else 0) for i, text in enumerate(texts)]


def _each(value) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]
