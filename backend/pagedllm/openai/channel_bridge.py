"""The wire to the model over its engine channel (serving/engine_channel.py): one Unix-socket connection for
every request of this front end, one line of JSON per message.

Why beside the HTTP bridge: through Triton, each streamed token is a response the model sends to tritonserver
and an HTTP event this process reads and parses, per request; over the channel the model writes one line per
step holding every request's new text, and a cancellation is a line back, acted on at once (no heartbeat needed).
Readiness is still Triton's (the model's ready endpoint): the channel lives and dies with the model.

A request's events arrive in order; its last has `"final": true`. Leaving the generator before that (the client
went away, an exception) sends `{"cancel": id}`, and the model aborts the request and frees its KV blocks. If the
connection breaks, every open request fails with 502 and the next request connects again.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator

from pagedllm.openai import triton_errors
from pagedllm.openai.protocol import OpenAIError
from pagedllm.openai.triton_bridge import Delta, TritonBridge, deltas_of, request_inputs

logger = logging.getLogger(__name__)

_BROKEN = {"broken": True}  # queued to every open request when the connection ends
_LINE_LIMIT = 1 << 30  # one line holds a step's events, or a final-only completion with its logprobs


class ChannelBridge:
    def __init__(self, path: str, triton_url: str, model_name: str = "pagedllm") -> None:
        self.path = path
        self.triton = TritonBridge(triton_url, model_name)  # readiness: the model's, through Triton
        self.ids = itertools.count()
        self.writer: asyncio.StreamWriter | None = None
        self.pending: dict[int, asyncio.Queue] = {}  # the current connection's open requests, by id
        self.reading: asyncio.Task | None = None  # its reader (kept: the loop holds tasks only weakly)
        self.connecting = asyncio.Lock()

    async def is_ready(self) -> bool:
        return await self.triton.is_ready()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        await self.triton.close()

    async def generate(self, sampling: dict, params: dict[str, str], *,
                       prompt: str | None = None, messages: list | None = None,
                       logprobs: bool = False, deltas: bool = True) -> AsyncIterator[Delta]:
        """As TritonBridge.generate: the request's deltas in order; raises OpenAIError."""
        writer, pending = await self._connection()
        request_id = next(self.ids)
        events: asyncio.Queue = asyncio.Queue()
        pending[request_id] = events
        done = False
        try:
            inputs = request_inputs(sampling, prompt, messages, logprobs, deltas)
            _write(writer, {"id": request_id, "inputs": inputs})
            while not done:
                event = await events.get()
                if event is _BROKEN:
                    done = True
                    raise OpenAIError(502, "engine channel: the connection to the model broke off")
                done = bool(event.get("final"))
                if "error" in event:
                    raise triton_errors.from_stream_message(event["error"], params)
                for delta in deltas_of(event):
                    yield delta
        finally:
            pending.pop(request_id, None)
            if not done and not writer.is_closing():
                _write(writer, {"cancel": request_id})

    async def _connection(self) -> tuple[asyncio.StreamWriter, dict[int, asyncio.Queue]]:
        """The connection to the model (made anew if there is none, or it broke) and its open requests."""
        async with self.connecting:
            if self.writer is None or self.writer.is_closing():
                try:
                    reader, self.writer = await asyncio.open_unix_connection(self.path, limit=_LINE_LIMIT)
                except OSError as e:
                    raise OpenAIError(503, f"engine channel: unreachable ({self.path}): {e}") from None
                self.pending = {}  # a broken connection's requests are its reader's to fail, not the new one's
                self.reading = asyncio.get_running_loop().create_task(
                    self._read(reader, self.writer, self.pending))
            return self.writer, self.pending

    @staticmethod
    async def _read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    pending: dict[int, asyncio.Queue]) -> None:
        """Hand each event to its request until the connection ends; then fail what is still open on it."""
        try:
            while line := await reader.readline():
                for request_id, event in json.loads(line):
                    events = pending.get(request_id)
                    if events is not None:
                        events.put_nowait(event)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the model went away
        except Exception:  # a line it should not have sent: say so, then fail what is open like a break
            logger.exception("engine channel: an unreadable line from the model; the connection is dropped")
        finally:
            writer.close()
            for events in list(pending.values()):
                events.put_nowait(_BROKEN)


def _write(writer: asyncio.StreamWriter, message: dict) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
