"""The engine channel: `pagedllm openai`'s own way into the model, a Unix socket beside Triton's endpoints.

Why: through Triton, every streamed token of every request is a response of its own, a round trip from this
process to tritonserver and then an HTTP write that the front end reads and parses; at 64 streams that is ~64 of
each per step, and on a 2-core host the threads doing them take their time from the forward pass (perf/README,
session 44). Over the channel one step's outputs for every request of a front end are one write and one read.

Wire: one JSON document per line, both ways, over one connection per front end.
- front end -> model: `{"id": n, "inputs": {...}, "parameters": {...}}` (a request: the inputs by name, as
  the generate endpoint takes them: strings, booleans, numbers; the request parameters) or `{"cancel": n}`.
- model -> front end: `[[n, event], ...]`, the events of one flush; an event is what Triton's generate_stream
  writes for a response (each output by name: a one-element output as a scalar, others as a list), or
  `{"error": message}`; a request's last event has `"final": true`.
A connection that closes cancels every request it sent that is still running.

No Triton import: the model hands in what to do with a request and a cancellation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable

import numpy as np

logger = logging.getLogger(__name__)

# Inputs the channel takes, and their Triton types (config.pbtxt): the front end's requests use these only.
STRING_INPUTS = frozenset({"text_input", "messages", "sampling_parameters"})
BOOL_INPUTS = frozenset({"stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
                         "return_logprobs", "return_num_input_tokens", "return_num_output_tokens"})


class ChannelRequestError(ValueError):
    """A request line the model cannot read (not a request of the front end's shape)."""


def to_arrays(inputs: dict) -> dict[str, np.ndarray]:
    """A request's inputs as the [1]-shaped numpy arrays Triton would hand the model."""
    arrays = {}
    for name, value in inputs.items():
        if name in STRING_INPUTS and isinstance(value, str):
            arrays[name] = np.array([value.encode("utf-8")], dtype=np.object_)
        elif name in BOOL_INPUTS and isinstance(value, bool):
            arrays[name] = np.array([value], dtype=np.bool_)
        else:
            raise ChannelRequestError(f"{name}: not an input the engine channel takes (or not of its type)")
    return arrays


def to_event(arrays: dict[str, np.ndarray]) -> dict:
    """Output arrays as Triton's generate endpoint writes them: bytes as text, one element as a scalar."""
    event = {}
    for name, array in arrays.items():
        values = [v.decode("utf-8") if isinstance(v, bytes) else v for v in array.ravel().tolist()]
        event[name] = values[0] if len(values) == 1 else values
    return event


class ChannelStream:
    """One request's way back over the channel; the final event closes it (nothing is sent afterwards)."""

    def __init__(self, connection: ChannelConnection, request_id: int) -> None:
        self.connection = connection
        self.request_id = request_id
        self.rid: str | None = None  # the model's id for it, once admitted
        self.closed = False
        self.cancel_requested = False  # the front end sent `cancel`, or its connection closed

    def send_outputs(self, arrays: dict[str, np.ndarray], final: bool = False) -> None:
        self._send({**to_event(arrays), "final": True} if final else to_event(arrays), final)

    def send_error(self, message: str, code: str = "INTERNAL") -> None:
        """`code` (Triton's name for it) is not sent: the front end reads an error's kind from its text."""
        self._send({"error": message, "final": True}, True)

    def send_heartbeat(self) -> None:
        """Nothing: the channel learns of a cancellation without writing to it."""

    def is_cancelled(self) -> bool:
        return self.cancel_requested and not self.closed

    def _send(self, event: dict, final: bool) -> None:
        if self.closed:
            return
        self.closed = final
        self.connection.queue(self.request_id, event)


class ChannelConnection:
    """One front end's connection: a reader thread takes its requests; events queue until `flush`."""

    def __init__(self, sock: socket.socket, on_request: Callable, on_cancel: Callable) -> None:
        self.sock = sock
        self.on_request = on_request  # (stream, inputs arrays, parameters dict) -> None; errors sent by it
        self.on_cancel = on_cancel  # (stream) -> None
        self.streams: dict[int, ChannelStream] = {}
        self.outbox: list = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="pagedllm-channel-reader", daemon=True)

    def queue(self, request_id: int, event: dict) -> None:
        with self.lock:
            self.outbox.append([request_id, event])
            if event.get("final"):
                self.streams.pop(request_id, None)

    def flush(self) -> None:
        """Write everything queued as one line (nothing if the front end is gone: its requests are cancelled)."""
        with self.lock:
            if not self.outbox:
                return
            line = json.dumps(self.outbox).encode() + b"\n"
            self.outbox = []
            with contextlib.suppress(OSError):
                self.sock.sendall(line)

    def _read(self) -> None:
        try:
            with self.sock.makefile("rb") as lines:
                for line in lines:
                    self._handle(line)
        except OSError:
            pass
        finally:
            with self.lock:
                left = list(self.streams.values())
                self.streams.clear()
            for stream in left:  # the front end is gone: nobody reads these any more
                stream.cancel_requested = True
                self.on_cancel(stream)
            with contextlib.suppress(OSError):
                self.sock.close()

    def _handle(self, line: bytes) -> None:
        try:
            message = json.loads(line)
            if "cancel" in message:
                with self.lock:
                    stream = self.streams.get(message["cancel"])
                if stream is not None:
                    stream.cancel_requested = True
                    self.on_cancel(stream)
                return
            stream = ChannelStream(self, int(message["id"]))
        except (ValueError, KeyError, TypeError) as e:
            logger.error("engine channel: a line that is not a request (%s): %.200r", e, line)
            return
        with self.lock:
            self.streams[stream.request_id] = stream
        try:
            arrays = to_arrays(message.get("inputs") or {})
            parameters = message.get("parameters") or {}
            if not isinstance(parameters, dict):
                raise ChannelRequestError("parameters: must be an object")
        except ChannelRequestError as e:
            stream.send_error(str(e))
        else:
            self.on_request(stream, arrays, parameters)
        self.flush()  # a request refused at once hears of it now, not after the next step


class ChannelServer:
    """Listens on a Unix socket (made private to this user); each connection gets its reader thread."""

    def __init__(self, path: str, on_request: Callable, on_cancel: Callable) -> None:
        self.path = path
        self.on_request, self.on_cancel = on_request, on_cancel
        self.connections: list[ChannelConnection] = []
        self.lock = threading.Lock()
        if _answers(path):  # another instance of the model serves it: two on one path would steal it
            raise OSError(f"engine channel {path} is served by another process")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a process that is gone
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen()
        self.acceptor = threading.Thread(target=self._accept, name="pagedllm-channel", daemon=True)
        self.acceptor.start()
        logger.info("engine channel for the OpenAI front end at %s", path)

    def flush(self) -> None:
        with self.lock:
            connections = list(self.connections)
        for connection in connections:
            connection.flush()

    def stop_listening(self) -> None:
        """No new connections, and the path free for the instance that loads next (a reload after an engine
        failure loads it while this one still finalizes); open connections still get what is queued for them."""
        if self.listener.fileno() < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # first: once closed, the path may be a successor's, not ours to remove
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def close(self) -> None:
        """Stop listening, send each connection what is queued for it, then close them all."""
        self.stop_listening()
        with self.lock:
            connections, self.connections = self.connections, []
        for connection in connections:
            connection.flush()
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # closed
                return
            connection = ChannelConnection(sock, self.on_request, self.on_cancel)
            with self.lock:
                self.connections = [c for c in self.connections if c.reader.is_alive()] + [connection]
            connection.reader.start()


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
