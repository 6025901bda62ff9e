"""The Triton adapter's handling of response senders, under a stand-in for triton_python_backend_utils (the
real one exists only inside Triton's stub; the end-to-end tests use the real server). The stand-in's senders
record misuse the way Triton 24.10 punishes it: `send` after the final response raises, `is_cancelled` after
it would read freed memory. Every request must get exactly one final response, whatever happens: bad input,
cancellation, a dead engine and its restart, finalize with requests in flight; and so must every request that
came over the engine channel (a real Unix socket) beside them."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import types

import numpy as np
import pytest

from conftest import wait_for
from pagedllm.serving.response_channel import ResponseChannel

FINAL = 1


class FakeSender:
    def __init__(self) -> None:
        self.responses, self.finals, self.misuse = [], 0, []
        self.cancel = False

    def send(self, response=None, flags=0):
        if self.finals:
            self.misuse.append("send after the final response")
            raise RuntimeError("Unable to send response. Response sender has been closed.")
        self.responses.append(response)
        self.finals += bool(flags & FINAL)

    def is_cancelled(self):
        if self.finals:
            self.misuse.append("is_cancelled after the final response")
        return self.cancel


class FakeTensor:
    def __init__(self, name, value):
        self._name, self._value = name, value

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class FakeRequest:
    def __init__(self, prompt: str, sampling: dict, rid: str):
        self.sender = FakeSender()
        self._inputs = [FakeTensor("text_input", np.array([prompt.encode()], dtype=np.object_)),
                        FakeTensor("stream", np.array([True])),
                        FakeTensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_))]
        self._rid = rid

    def inputs(self):
        return self._inputs

    def parameters(self):
        return "{}"

    def request_id(self):
        return self._rid

    def get_response_sender(self):
        return self.sender


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=0):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors, error


class TritonModelException(Exception):
    pass


def fake_pb_utils(unload_allowed: bool):
    m = types.ModuleType("triton_python_backend_utils")
    m.TritonError, m.InferenceResponse, m.TritonModelException = TritonError, InferenceResponse, TritonModelException
    m.Tensor = lambda name, value: (name, value)
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    m.using_decoupled_model_transaction_policy = lambda config: True
    m.unloads, m.loads = [], []

    def unload_model(name):
        if not unload_allowed:
            raise TritonModelException("explicit model load / unload is not allowed if polling is enabled")
        m.unloads.append(name)

    m.unload_model = unload_model
    m.load_model = lambda name, config=None, files=None: m.loads.append((name, json.loads(config)))
    return m


class ChannelClient:
    """The front end's end of the engine channel, reduced to a socket and a reader thread: every event by id."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.events: dict[int, list[dict]] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def request(self, rid: int, prompt: str, sampling: dict) -> None:
        self.events[rid] = []
        self.send({"id": rid, "inputs": {"text_input": prompt, "stream": True,
                                         "sampling_parameters": json.dumps(sampling)}})

    def finals(self, rid: int) -> list[dict]:
        return [e for e in self.events[rid] if e.get("final")]

    def _read(self) -> None:
        with self.sock.makefile("rb") as lines:
            for line in lines:
                for rid, event in json.loads(line):
                    self.events[rid].append(event)


@pytest.fixture
def adapter(llama_dir, tmp_path, monkeypatch):
    def make(fault_token: int, unload_allowed: bool):
        pb = fake_pb_utils(unload_allowed)
        monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
        monkeypatch.delitem(sys.modules, "pagedllm.serving.triton_model", raising=False)
        from pagedllm.serving.triton_model import TritonPythonModel

        (tmp_path / "1").mkdir()
        (tmp_path / "1" / "engine.json").write_text(json.dumps({
            "model": llama_dir, "dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 8 << 20,
            "fault_injection": {"point": "forward", "token_id": fault_token}, "engine_restart_backoff_s": 0.05,
            "engine_restart": "reload" if unload_allowed else "in_process",
            "openai_channel": str(tmp_path / "channel.sock")}))
        config = {"name": "pagedllm", "parameters": {"enable_metrics": {"string_value": "false"}}}
        model = TritonPythonModel()
        model.initialize({"model_config": json.dumps(config), "model_name": "pagedllm",
                          "model_repository": str(tmp_path), "model_version": "1"})
        return model, pb

    return make


def _token_of(llama_dir, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir).encode(text)[-1]


def _finals_only_once(requests):
    for r in requests:
        assert r.sender.finals == 1, (r.request_id(), r.sender.finals, r.sender.responses)
        assert not r.sender.misuse, r.sender.misuse


@pytest.mark.parametrize("unload_allowed", [False, True], ids=["in-process-restart", "explicit-reload"])
def test_every_request_gets_one_final_response_through_death_restart_and_finalize(adapter, llama_dir,
                                                                                   unload_allowed):
    trigger = "a zebra"
    model, pb = adapter(_token_of(llama_dir, trigger), unload_allowed)
    long = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
    requests = [FakeRequest(f"def f{i}():", long, f"r{i}") for i in range(4)]
    bad = FakeRequest("hi", {"max_tokens": -1}, "bad")
    cancelled = FakeRequest("import os", long, "cancelled")
    model.execute(requests + [bad, cancelled])
    channel = ChannelClient(model.serving.openai_channel)  # beside Triton's requests: the front end's
    for i in range(3):
        channel.request(i, f"def g{i}():", long)
    channel.request(3, "hi", {"max_tokens": -1})
    wait_for(lambda: all(len(channel.events[i]) >= 2 for i in range(3)) and channel.finals(3))
    channel.send({"cancel": 2})
    wait_for(lambda: all(len(r.sender.responses) >= 2 for r in requests + [cancelled]))
    cancelled.sender.cancel = True
    wait_for(lambda: cancelled.sender.finals and channel.finals(2))
    assert model.num_cancelled == 2  # each counted once (the channel's reader and the sweep may both see one)
    model.execute([FakeRequest(trigger, long, "trigger")])  # the forward pass fails: the engine is dead
    wait_for(lambda: all(r.sender.finals for r in requests) and channel.finals(0) and channel.finals(1))
    for r in requests:
        assert r.sender.responses[-1].error.code == TritonError.UNAVAILABLE
        assert "engine failed" in r.sender.responses[-1].error.message
    assert bad.sender.responses[-1].error.code == TritonError.INVALID_ARG
    assert cancelled.sender.responses[-1].error.code == TritonError.CANCELLED
    assert [channel.events[i][-1]["error"].split(":")[0] for i in range(4)] == [
        "engine failed", "engine failed", "request was cancelled", "max_tokens"]
    if unload_allowed:  # explicit model control: the model unloads itself and asks Triton to load it again
        wait_for(lambda: pb.loads)
        name, config = pb.loads[0]
        assert pb.unloads == ["pagedllm"] and config["parameters"]["pagedllm_engine_restarts"]["string_value"] == "1"
        late = [FakeRequest("def late():", {"max_tokens": 4}, "late")]
        model.execute(late)  # the old instance refuses what still reaches it
        assert late[0].sender.responses[-1].error.code == TritonError.UNAVAILABLE
        # ... and no longer listens on the channel (the instance loading next takes its path)
        with pytest.raises(ConnectionRefusedError):
            ChannelClient(model.serving.openai_channel)
        late_on_channel = []
    else:  # in process: the engine comes back and serves
        wait_for(lambda: model.loop.healthy, timeout=120)
        assert model.loop.restarts == 1
        late = [FakeRequest(f"def again{i}():", long, f"again{i}") for i in range(3)]
        model.execute(late)
        late_on_channel = [4, 5]
        for i in late_on_channel:
            channel.request(i, f"def h{i}():", long)
        wait_for(lambda: all(len(r.sender.responses) >= 2 for r in late)
                 and all(len(channel.events[i]) >= 2 for i in late_on_channel))
    model.finalize()  # with requests still in flight: each gets its one final error
    _finals_only_once(requests + late + [bad, cancelled])
    wait_for(lambda: all(channel.finals(i) for i in late_on_channel))
    for i, events in channel.events.items():  # one final event each, and nothing after it
        assert len(channel.finals(i)) == 1 and events[-1].get("final"), (i, events[-2:])
    for i in late_on_channel:
        assert channel.events[i][-1]["error"].startswith("request aborted")


def test_a_channel_refuses_everything_after_its_final_response():
    sender = FakeSender()
    channel = ResponseChannel(sender, FINAL)
    assert channel.send("a") and channel.send("b", final=True)
    assert not channel.send("c") and not channel.send("d", final=True)
    assert channel.is_cancelled() is False
    assert sender.responses == ["a", "b"] and not sender.misuse and channel.refused == 2


def test_a_channel_is_safe_across_threads():
    """Many threads race to send and to ask; the final response is the last one sent, and the only final."""
    sender = FakeSender()
    channel = ResponseChannel(sender, FINAL)
    stop = time.monotonic() + 0.5

    def spam(final_at):
        n = 0
        while time.monotonic() < stop:
            channel.send(n, final=(n == final_at))
            channel.is_cancelled()
            n += 1

    threads = [threading.Thread(target=spam, args=(50 * i + 500,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sender.finals == 1 and not sender.misuse


def test_a_batch_of_outputs_sends_the_requests_first_responses_first(monkeypatch):
    """A new request's first token (its TTFT) does not wait behind the running streams' next tokens; otherwise
    the batch keeps its order."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils(False))
    monkeypatch.delitem(sys.modules, "pagedllm.serving.triton_model", raising=False)
    from pagedllm.serving.triton_model import TritonPythonModel

    model = object.__new__(TritonPythonModel)  # only its in-flight table is used
    model.lock = threading.Lock()

    def in_flight(tokens_sent):
        return types.SimpleNamespace(builder=types.SimpleNamespace(tokens_so_far=tokens_sent))

    model.inflight = {"a": in_flight(5), "b": in_flight(0), "c": in_flight(9), "d": in_flight(0)}
    items = [(rid, f"output of {rid}", None) for rid in "acbdx"]  # x: finished meanwhile, no longer in flight
    assert [rid for rid, _, _ in model._first_responses_first(items)] == ["b", "d", "a", "c", "x"]
    model.inflight = {"a": in_flight(5), "c": in_flight(9)}
    assert model._first_responses_first(items) == items
