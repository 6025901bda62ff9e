"""The wire to Triton: one request's input tensors, and its responses read from a gRPC bidirectional stream
(`tritonclient.grpc.aio`), one stream per HTTP request.

Every request runs with `stream=True` on the model (DELTA outputs), streamed to the HTTP client or not: one
code path, and a non-streamed request is just the deltas joined (except a completion with best_of > n, whose
best samples are known only at the end: the model sends it as one final response, read the same way). The
stream's end for the request is Triton's `triton_final_response` parameter (asked for with
`triton_enable_empty_final_response`); an error response is always final (the model sends its errors with the FINAL flag). After it the stream is half-closed and Triton
ends it with OK. Leaving the generator before that, by an exception, a cancellation (the HTTP client went away)
or `aclose()`, cancels the gRPC call; Triton then cancels the stream's in-flight request and the model aborts
it and frees its KV blocks. (A finished request's stream is never cancelled: with Triton 2.51, cancelling one
right after its final response now and then leaves the model referenced, and tritonserver's shutdown then
waits out its whole exit timeout; tests/openai checks the shutdown.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

from pagedllm.openai import triton_errors
from pagedllm.openai.protocol import OpenAIError


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
        # A grpc.aio channel belongs to the event loop it is made in: make the bridge inside the server's loop.
        self.client = triton.InferenceServerClient(url)
        self.model_name = model_name

    async def is_ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model_name))
        except (InferenceServerException, grpc.RpcError):  # Triton unreachable: not ready either
            return False

    async def close(self) -> None:
        await self.client.close()

    async def generate(self, request_id: str, sampling: dict, params: dict[str, str], *,
                       prompt: str | None = None, messages: list | None = None,
                       logprobs: bool = False, deltas: bool = True) -> AsyncIterator[Delta]:
        """The request's deltas, in order; raises OpenAIError (`params` names request fields in its `param`).
        Consume it inside `contextlib.aclosing` so that leaving early cancels the call at once. `deltas`
        False asks the model for one final response instead (best_of > n can only answer at the end)."""
        request = {"model_name": self.model_name, "request_id": request_id,
                   "inputs": _inputs(sampling, prompt, messages, logprobs, deltas),
                   "parameters": {"triton_enable_empty_final_response": True}}
        finished = asyncio.Event()

        async def requests():
            yield request
            # Half-closing the stream early would be legal, but holding it open until the final response keeps
            # the request's lifetime and the stream's the same.
            await finished.wait()

        call = self.client.stream_infer(requests())
        ended = False  # the stream ended cleanly after the request's last response
        try:
            async for result, error in call:
                got, final = ([], True) if error is not None else _read(result)
                if final:
                    ended = await _end(call, finished)
                if error is not None:
                    raise triton_errors.from_stream_message(error.message(), params)
                for delta in got:
                    yield delta
                if final:
                    return
            raise OpenAIError(502, "Triton ended the stream before the request's final response")
        except grpc.aio.AioRpcError as e:
            raise triton_errors.from_rpc_error(e) from None
        finally:
            finished.set()
            if not ended:  # an error of the call, or the HTTP client gone: Triton cancels what is in flight
                call.cancel()


async def _end(call, finished: asyncio.Event) -> bool:
    """After the request's last response: half-close the stream and let Triton end it with OK (True), rather
    than cancel a stream whose request is already done, which can race Triton's handling of that response."""
    finished.set()
    try:
        async with asyncio.timeout(5):
            async for _ in call:
                pass
        return True
    except (TimeoutError, grpc.aio.AioRpcError):
        return False


def _inputs(sampling: dict, prompt: str | None, messages: list | None, logprobs: bool, stream: bool) -> list:
    inputs = []

    def add(name: str, value, dtype: str) -> None:
        arr = np.array([value], dtype=np.object_ if dtype == "BYTES" else bool)
        t = triton.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)

    # Exactly one of text_input / messages: the model renders messages with its chat template.
    if messages is not None:
        add("messages", json.dumps(messages).encode(), "BYTES")
    else:
        add("text_input", prompt.encode(), "BYTES")
    add("stream", stream, "BOOL")
    add("sampling_parameters", json.dumps(sampling).encode(), "BYTES")
    add("exclude_input_in_output", True, "BOOL")  # OpenAI never repeats the prompt (echo is refused)
    for flag in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"):
        add(flag, True, "BOOL")
    if logprobs:
        add("return_logprobs", True, "BOOL")
    return inputs


def _read(result) -> tuple[list[Delta], bool]:
    """(the response's deltas: one per sequence it carries, none for an empty final response; whether it is the
    request's last)."""
    response = result.get_response()
    final = ("triton_final_response" in response.parameters
             and response.parameters["triton_final_response"].bool_param)
    if not response.outputs:
        return [], final

    def each(name: str) -> list:
        arr = result.as_numpy(name)
        return [] if arr is None else list(arr.reshape(-1))

    texts, reasons, n_outs, lps, index = (each(n) for n in ("text_output", "finish_reason", "num_output_tokens",
                                                            "logprobs", "sequence_index"))
    n_in = each("num_input_tokens")
    return [Delta(text=_str(text), num_output_tokens=int(n_outs[i]) if n_outs else 0,
                  num_input_tokens=int(n_in[0]) if n_in and i == 0 else None,
                  finish_reason=_str(reasons[i]) or None if reasons else None,
                  logprobs=json.loads(_str(lps[i])) if lps else None,
                  index=int(index[i]) if index else 0) for i, text in enumerate(texts)], final


def _str(value) -> str:
    if value is None:
        return ""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
