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
        self.connection.queue(self, event, final)


class ChannelConnection:
    """One front end's connection: a reader thread takes its requests; events queue until `flush`, which hands
    them as one line to the connection's writer thread. The model's response thread never blocks on a front end:
    one that stops reading only grows its own backlog, and past MAX_BACKLOG_BYTES it is dropped (the connection
    shut, so its requests are cancelled) rather than held in memory without end."""

    MAX_BACKLOG_BYTES = 256 << 20
    MAX_LINE_BYTES = 256 << 20  # a request line (a prompt is at most engine.json's max_prompt_bytes)

    def __init__(self, sock: socket.socket, on_request: Callable, on_cancel: Callable) -> None:
        self.sock = sock
        self.on_request = on_request  # (stream, inputs arrays, parameters dict) -> None; errors sent by it
        self.on_cancel = on_cancel  # (stream) -> None
        self.streams: dict[int, ChannelStream] = {}
        self.outbox: list = []  # events queued since the last flush
        self.backlog: list[bytes] = []  # flushed lines the writer has yet to send
        self.backlog_bytes = 0
        self.closing = False  # no more lines: the writer sends the backlog, then shuts the connection
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.reader = threading.Thread(target=self._read, name="pagedllm-channel-reader", daemon=True)
        self.writer = threading.Thread(target=self._write, name="pagedllm-channel-writer", daemon=True)

    def start(self) -> None:
        self.writer.start()  # first: the reader joins it when it ends
        self.reader.start()

    def queue(self, stream: ChannelStream, event: dict, final: bool) -> None:
        """Queue a stream's event; nothing once its final event was queued (checked under the lock: two threads
        may end a request at once, finalize and a late refusal, say)."""
        with self.lock:
            if stream.closed:
                return
            stream.closed = final
            self.outbox.append([stream.request_id, event])
            if final and self.streams.get(stream.request_id) is stream:
                del self.streams[stream.request_id]

    def flush(self) -> None:
        """Hand everything queued to the writer as one line (dropped if the connection is closing)."""
        with self.lock:
            if not self.outbox or self.closing:
                self.outbox = []
                return
            line = json.dumps(self.outbox).encode() + b"\n"
            self.outbox = []
            self.backlog.append(line)
            self.backlog_bytes += len(line)
            if self.backlog_bytes > self.MAX_BACKLOG_BYTES:
                logger.error("engine channel: a front end %d MiB behind in reading is dropped",
                             self.backlog_bytes >> 20)
                self.backlog, self.closing = [], True
                self._shut()  # the writer may be stuck in a send to it: this fails that send, and ends the reader
            self.wake.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Send what was flushed (for up to `timeout` seconds), then shut the connection."""
        with self.lock:
            self.closing = True
            self.wake.notify()
        self.writer.join(timeout)
        self._shut()

    def _write(self) -> None:
        while True:
            with self.lock:
                while not self.backlog and not self.closing:
                    self.wake.wait()
                lines, self.backlog, self.backlog_bytes = self.backlog, [], 0
                done = self.closing
            try:
                self.sock.sendall(b"".join(lines))
            except OSError:
                done = True
            if done:
                self._shut()  # the reader sees the end and cancels what is still open
                return

    def _shut(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        try:
            with self.sock.makefile("rb") as lines:
                while line := lines.readline(self.MAX_LINE_BYTES + 1):
                    if len(line) > self.MAX_LINE_BYTES:
                        logger.error("engine channel: a line of over %d MiB; the connection is dropped",
                                     self.MAX_LINE_BYTES >> 20)
                        break
                    self._handle(line)
        except OSError:
            pass
        finally:
            with self.lock:
                self.closing = True
                left = list(self.streams.values())
                self.streams.clear()
                self.wake.notify()
            self._shut()  # the front end is gone (or dropped): nothing more goes to it, and no write blocks
            for stream in left:  # nobody reads these any more
                stream.cancel_requested = True
                self.on_cancel(stream)
            self.writer.join(5.0)
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
            inputs, parameters = message.get("inputs") or {}, message.get("parameters") or {}
            if not isinstance(inputs, dict) or not isinstance(parameters, dict):
                raise ChannelRequestError("inputs, parameters: must be objects")
            arrays = to_arrays(inputs)
        except (ChannelRequestError, UnicodeError) as e:
            stream.send_error(str(e))
        else:
            try:
                self.on_request(stream, arrays, parameters)
            except Exception as e:  # the model's intake failed for this one request: it alone gets the error
                logger.exception("engine channel: request %s", stream.request_id)
                stream.send_error(f"could not process the request: {type(e).__name__}: {e}")
        self.flush()  # a request refused at once hears of it now, not after the next step


class ChannelServer:
    """Listens on a Unix socket, private to this user; each connection gets its reader and writer threads.

    The newest instance of the model owns the path: Triton loads a model's next instance before it finalizes the
    last (a reload, an engine failure's reload), and front ends should reach the one that will stay. So the socket
    is bound under a name of its own and renamed onto the path (atomically replacing an older instance's, whose
    open connections carry on). An instance that stops listening leaves the path alone: removing it could race
    with a successor's rename, and a socket nobody listens on only refuses connections until the next instance
    replaces it."""

    def __init__(self, path: str, on_request: Callable, on_cancel: Callable) -> None:
        self.path = path
        self.on_request, self.on_cancel = on_request, on_cancel
        self.connections: list[ChannelConnection] = []
        self.lock = threading.Lock()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        own = f"{path}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(own)  # left by a process of the same pid, long gone
        umask = os.umask(0o177)  # created 0600: no moment at which another user could connect
        try:
            self.listener.bind(own)
        finally:
            os.umask(umask)
        self.listener.listen()
        os.replace(own, path)
        self.acceptor = threading.Thread(target=self._accept, name="pagedllm-channel", daemon=True)
        self.acceptor.start()
        logger.info("engine channel for the OpenAI front end at %s", path)

    def flush(self) -> None:
        with self.lock:
            connections = list(self.connections)
        for connection in connections:
            connection.flush()

    def stop_listening(self) -> None:
        """No new connections (a front end connecting gets a refusal until the next instance takes the path);
        open connections still get what is queued for them."""
        if self.listener.fileno() < 0:
            return
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
            connection.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # closed
                return
            connection = ChannelConnection(sock, self.on_request, self.on_cancel)
            connection.start()
            with self.lock:
                closed = self.listener.fileno() < 0  # close() ran meanwhile and did not see this one
                if not closed:
                    self.connections = [c for c in self.connections if c.reader.is_alive()] + [connection]
            if closed:
                connection.close()

