"""The engine channel's model side (serving/engine_channel.py) over a real Unix socket, with the model's two
callbacks stood in for: requests in as Triton-shaped arrays, one line per flush out, cancellation by message
and by a closed connection, and a second server refused on a live path."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import numpy as np
import pytest
from pagedllm.serving.engine_channel import ChannelConnection, ChannelServer, to_arrays, to_event

pytestmark = [pytest.mark.serving]


class Model:
    """What the model does with the channel's requests, recorded."""

    def __init__(self) -> None:
        self.requests: list = []
        self.cancelled: list = []
        self.arrived = threading.Event()
        self.cancel_seen = threading.Event()

    def on_request(self, stream, arrays, parameters) -> None:
        self.requests.append((stream, arrays, parameters))
        self.arrived.set()

    def on_cancel(self, stream) -> None:
        self.cancelled.append(stream)
        self.cancel_seen.set()


@pytest.fixture
def served(tmp_path):
    model = Model()
    server = ChannelServer(str(tmp_path / "channel.sock"), model.on_request, model.on_cancel)
    yield server, model
    server.close()


def connect(server: ChannelServer) -> tuple[socket.socket, object]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(server.path)
    return sock, sock.makefile("rb")


def send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_inputs_become_triton_shaped_arrays_and_outputs_become_generate_events():
    arrays = to_arrays({"text_input": "héllo", "stream": True, "sampling_parameters": "{}"})
    assert arrays["text_input"].dtype == np.object_ and arrays["text_input"].tolist() == ["héllo".encode()]
    assert arrays["stream"].dtype == np.bool_ and arrays["stream"].shape == (1,)
    event = to_event({"text_output": np.array([b"a", "é".encode()], dtype=np.object_),
                      "num_input_tokens": np.array([7], dtype=np.uint32)})
    assert event == {"text_output": ["a", "é"], "num_input_tokens": 7}  # one element: a scalar, as Triton writes
    for bad in ({"text_input": 3}, {"stream": "yes"}, {"max_tokens": 4}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            to_arrays(bad)


def test_a_flush_carries_every_queued_event_in_one_line(served):
    server, model = served
    sock, lines = connect(server)
    for i in range(3):
        send(sock, {"id": i, "inputs": {"text_input": f"p{i}", "stream": True}, "parameters": {"x": 1}})
    wait_for(lambda: len(model.requests) == 3)
    assert [a["text_input"].tolist() for _, a, _ in model.requests] == [[b"p0"], [b"p1"], [b"p2"]]
    assert model.requests[0][2] == {"x": 1}
    for stream, _, _ in model.requests:
        stream.send_outputs({"text_output": np.array([b"t"], dtype=np.object_)})
    model.requests[1][0].send_outputs({"text_output": np.array([b"end"], dtype=np.object_)}, final=True)
    server.flush()
    assert json.loads(lines.readline()) == [[0, {"text_output": "t"}], [1, {"text_output": "t"}],
                                            [2, {"text_output": "t"}], [1, {"text_output": "end", "final": True}]]
    # A final event closes its stream: nothing more goes out for it, and it is not cancelled by a close.
    model.requests[1][0].send_outputs({"text_output": np.array([b"late"], dtype=np.object_)})
    model.requests[1][0].send_error("late too")
    server.flush()
    lines.close()
    sock.close()  # the front end gone (its file and socket both closed: only then is the connection)
    wait_for(lambda: len(model.cancelled) == 2)
    assert sorted(s.request_id for s in model.cancelled) == [0, 2]


def test_a_cancel_message_cancels_that_request_only(served):
    server, model = served
    sock, lines = connect(server)
    send(sock, {"id": 5, "inputs": {"text_input": "a"}})
    send(sock, {"id": 6, "inputs": {"text_input": "b"}})
    wait_for(lambda: len(model.requests) == 2)
    send(sock, {"cancel": 6})
    send(sock, {"cancel": 99})  # unknown (already finished, say): nothing happens
    assert model.cancel_seen.wait(10)
    time.sleep(0.2)
    assert [s.request_id for s in model.cancelled] == [6]
    assert model.cancelled[0].is_cancelled() and not model.requests[0][0].is_cancelled()
    model.cancelled[0].send_error("request was cancelled", "CANCELLED")
    server.flush()
    assert json.loads(lines.readline()) == [[6, {"error": "request was cancelled", "final": True}]]


def test_a_request_the_channel_cannot_read_is_refused_at_once_and_the_connection_lives_on(served):
    server, model = served
    sock, lines = connect(server)
    sock.sendall(b"not json\n")
    send(sock, {"no id": 1})
    send(sock, {"id": 1, "inputs": {"lora_weights": [1.0]}})
    assert json.loads(lines.readline()) == [[1, {"error": "lora_weights: not an input the engine channel takes "
                                                          "(or not of its type)", "final": True}]]
    send(sock, {"id": 2, "inputs": {"text_input": "fine"}})
    assert model.arrived.wait(10)
    assert [s.request_id for s, _, _ in model.requests] == [2]


def test_the_newest_server_takes_the_path_and_an_older_ones_connections_carry_on(served, tmp_path):
    """Triton loads a model's next instance before it finalizes the last: the next one takes the path (new
    front-end connections reach it), the old one keeps serving the connections it has, and stopping it leaves
    the path to the new one."""
    old, model = served
    kept, kept_lines = connect(old)
    newer_model = Model()
    newer = ChannelServer(old.path, newer_model.on_request, newer_model.on_cancel)
    try:
        assert oct(os.stat(old.path).st_mode & 0o777) == oct(0o600)
        fresh, _ = connect(newer)
        send(fresh, {"id": 1, "inputs": {"text_input": "to the new one"}})
        assert newer_model.arrived.wait(10)
        send(kept, {"id": 2, "inputs": {"text_input": "to the old one"}})
        assert model.arrived.wait(10)
        model.requests[0][0].send_error("the model is being unloaded")
        old.close()
        assert json.loads(kept_lines.readline()) == [[2, {"error": "the model is being unloaded", "final": True}]]
        again, _ = connect(newer)  # the path is still the new one's
        send(again, {"id": 3, "inputs": {"text_input": "again"}})
        wait_for(lambda: len(newer_model.requests) == 2)
    finally:
        newer.close()
    with pytest.raises(ConnectionRefusedError):  # nobody listens there now, until the next instance
        connect(newer)
    stale = ChannelServer(old.path, model.on_request, model.on_cancel)  # a socket file left behind is replaced
    stale.close()


def test_a_request_the_model_fails_to_take_gets_its_error_and_the_connection_lives_on(served):
    server, model = served
    original = server.on_request

    def failing(stream, arrays, parameters):
        if arrays["text_input"].tolist() == [b"boom"]:
            raise RuntimeError("tokenizer exploded")
        original(stream, arrays, parameters)

    server.on_request = failing
    sock, lines = connect(server)
    send(sock, {"id": 1, "inputs": {"text_input": "boom"}})
    assert json.loads(lines.readline()) == [[1, {"error": "could not process the request: RuntimeError: tokenizer "
                                                          "exploded", "final": True}]]
    send(sock, {"id": 2, "inputs": ["not", "an", "object"]})
    assert json.loads(lines.readline())[0][1]["error"] == "inputs, parameters: must be objects"
    send(sock, {"id": 3, "inputs": {"text_input": "fine"}})
    assert model.arrived.wait(10) and not model.cancelled


@pytest.mark.parametrize("writer_stuck", [False, True], ids=["writer-waiting", "writer-stuck-in-a-send"])
def test_a_front_end_that_stops_reading_never_blocks_a_flush_and_is_dropped(served, monkeypatch, writer_stuck):
    """The model's response thread flushes; a front end that reads nothing must not stall it (every other request
    waits on that thread). Its backlog grows to the limit, then the connection goes and its requests are
    cancelled. With `writer_stuck` the flood yields between flushes, so the writer fills the socket and blocks in
    a send before the limit is reached (the usual case on a busy host, and the one that once hung here)."""
    server, model = served
    monkeypatch.setattr(ChannelConnection, "MAX_BACKLOG_BYTES", 1 << 20)
    sock, _ = connect(server)  # never read from
    send(sock, {"id": 1, "inputs": {"text_input": "a"}})
    wait_for(lambda: model.requests)
    stream = model.requests[0][0]
    token = {"text_output": np.array([b"x" * 4096], dtype=np.object_)}

    def flood() -> None:
        while not model.cancelled:
            stream.send_outputs(token)
            server.flush()
            if writer_stuck:
                time.sleep(0.001)

    flooding = threading.Thread(target=flood, daemon=True)
    flooding.start()
    flooding.join(60)
    assert not flooding.is_alive(), "a flush blocked on a front end that does not read"
    assert [s.request_id for s in model.cancelled] == [1]
    again, lines = connect(server)  # the server serves on
    send(again, {"id": 2, "inputs": {"text_input": "b"}})
    wait_for(lambda: len(model.requests) == 2)


def test_a_request_line_over_the_limit_drops_that_connection_only(served, monkeypatch):
    server, model = served
    monkeypatch.setattr(ChannelConnection, "MAX_LINE_BYTES", 1000)
    sock, lines = connect(server)
    send(sock, {"id": 1, "inputs": {"text_input": "short"}})
    wait_for(lambda: model.requests)
    send(sock, {"id": 2, "inputs": {"text_input": "y" * 2000}})
    assert lines.readline() == b""  # the model closed this connection ...
    wait_for(lambda: [s.request_id for s in model.cancelled] == [1])  # ... and cancelled what it had sent
    assert [s.request_id for s, _, _ in model.requests] == [1]
    other, _ = connect(server)
    send(other, {"id": 3, "inputs": {"text_input": "fine"}})
    wait_for(lambda: len(model.requests) == 2)


def test_the_channel_path_in_engine_json_is_checked_and_serve_lays_out_one_that_fits(tmp_path):
    from pagedllm.config import UNIX_SOCKET_PATH_MAX, ServingConfig
    from pagedllm.serving.launcher import engine_channel_path

    assert ServingConfig().openai_channel is None
    ok = "/" + "a" * (UNIX_SOCKET_PATH_MAX - 1)
    assert ServingConfig(openai_channel=ok).openai_channel == ok
    for bad in ("", ok + "a", 7):
        with pytest.raises(ValueError, match="openai_channel"):
            ServingConfig(openai_channel=bad)
    assert engine_channel_path(tmp_path) == str(tmp_path / "openai.sock")
    assert engine_channel_path(tmp_path / ("d" * UNIX_SOCKET_PATH_MAX)) is None  # too long: serve goes via HTTP
