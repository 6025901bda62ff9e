"""The front end alone, with a scripted stand-in for the Triton bridge (no server): what the model's errors
become (before the first token, and in the middle of a stream), the translation of request fields into the
model's sampling parameters, and a stalled stream cancelled when its client leaves. In-process uvicorn on a
free port."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn
from pagedllm.net import free_port
from pagedllm.openai.app import create_app
from pagedllm.openai.protocol import OpenAIError
from pagedllm.openai.triton_bridge import Delta
from pagedllm.openai.triton_errors import from_stream_message

MODEL = "pagedllm"


class ScriptedBridge:
    """Plays `script` (Deltas, exceptions, or "stall") for each request; records what it was asked."""

    def __init__(self) -> None:
        self.script: list = []
        self.calls: list[dict] = []
        self.closed = threading.Event()  # set when a request's generator is closed
        self.ready = True

    async def is_ready(self) -> bool:
        return self.ready

    async def close(self) -> None:
        pass

    async def generate(self, sampling, params, *, prompt=None, messages=None, logprobs=False,
                       deltas=True):
        self.calls.append({"sampling": sampling, "prompt": prompt, "messages": messages, "logprobs": logprobs,
                           "deltas": deltas})
        try:
            for item in self.script:
                if item == "stall":
                    await asyncio.sleep(3600)
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed.set()


@pytest.fixture(scope="module")
def frontend():
    app = create_app("127.0.0.1:1", served_model_name=MODEL)  # the channel is lazy: nothing listens there
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    bridge = app.state.bridge = ScriptedBridge()
    bridge.base = f"http://127.0.0.1:{server.config.port}"
    bridge.port = server.config.port
    yield bridge
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def bridge(frontend):
    frontend.script, frontend.calls = [], []
    frontend.closed.clear()
    frontend.ready = True
    return frontend


@pytest.fixture
def client(frontend):
    return openai.OpenAI(base_url=frontend.base + "/v1", api_key="unused", max_retries=0, timeout=30)


def post(bridge, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(bridge.base + path, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def done(text: str, n: int = 1, reason: str = "length") -> Delta:
    return Delta(text=text, num_output_tokens=n, num_input_tokens=4, finish_reason=reason)


@pytest.mark.parametrize("message, status, param", [
    ("temperature: must be a finite number >= 0, got -1.0", 400, "temperature"),
    ("sampling_parameters.top_k: expected an integer, got 'x'", 400, "top_k"),
    ("logprobs: 30 requested, at most 20 allowed", 400, "top_logprobs"),  # renamed for chat
    ("text_input: is empty", 400, "messages"),
    ("messages[1].content: expected a string or a list of text parts, got int", 400, "messages[1].content"),
    ("text_input or messages: exactly one is required", 400, None),
    ("prompt: 3000 tokens, at most 2047 allowed (max_model_len=2048)", 400, "prompt"),
    ("overloaded: 64 requests waiting (max_queue_size=64)", 503, None),
    ("engine is not running: engine failed: RuntimeError: x", 503, None),
    ("engine failed: InjectedFault: injected forward fault", 503, None),
    ("engine is restarting", 503, None),
    ("the model is being unloaded", 503, None),
    ("request aborted: the model is being unloaded", 503, None),
    ("Request for unknown model: 'pagedllm' has no available versions", 503, None),
    ("[request id: chatcmpl-1] Request for unknown model: 'pagedllm' is not found", 503, None),
    ("request failed: RuntimeError: injected detokenize fault", 500, None),
    ("could not process the request: KeyError: 'x'", 500, None),
])
def test_model_error_messages_map_to_statuses(message, status, param):
    e = from_stream_message(message, {"text_input": "messages", "logprobs": "top_logprobs"})
    assert (e.status, e.param) == (status, param)
    assert "request id" not in e.message and (param is None or e.message.startswith(param + ":"))


def test_error_before_the_first_token_keeps_its_status_when_streaming(bridge, client):
    bridge.script = [OpenAIError(503, "overloaded: 9 requests waiting (max_queue_size=8)")]
    status, body = post(bridge, "/v1/chat/completions", {"model": MODEL, "messages": [], "stream": True})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"  # validated before Triton
    status, body = post(bridge, "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert status == 503 and json.loads(body)["error"]["type"] == "server_error"
    with pytest.raises(openai.InternalServerError) as e:
        list(client.completions.create(model=MODEL, prompt="x", stream=True))
    assert e.value.status_code == 503 and "overloaded" in e.value.message


def test_error_mid_stream_is_an_sse_error_then_done(bridge, client):
    bridge.script = [Delta("Hello", 1, 4), OpenAIError(500, "request failed: RuntimeError: boom")]
    status, body = post(bridge, "/v1/chat/completions", {"model": MODEL, "stream": True,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hello"}
    assert chunks[2] == {"error": {"message": "request failed: RuntimeError: boom", "type": "server_error",
                                   "param": None, "code": None}}
    with pytest.raises(openai.APIError, match="boom"):
        list(client.completions.create(model=MODEL, prompt="x", stream=True))


def test_a_stalled_stream_is_cancelled_when_its_client_leaves(bridge):
    bridge.script = [Delta("a", 1, 4), "stall"]
    data = json.dumps({"model": MODEL, "prompt": "x", "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", bridge.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    got = b""
    while b'"text": "a"' not in got:
        got += s.recv(4096)
    assert not bridge.closed.is_set()
    s.close()  # no token will come to write: only the disconnect message can end it
    assert bridge.closed.wait(10)


def test_a_whole_completion_is_cancelled_when_its_client_leaves(bridge):
    bridge.script = ["stall"]
    data = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    s = socket.create_connection(("127.0.0.1", bridge.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    deadline = time.monotonic() + 10
    while not bridge.calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.close()
    assert bridge.closed.wait(10)


def test_request_fields_become_sampling_parameters(bridge, client):
    bridge.script = [done("ok")]
    client.completions.create(model=MODEL, prompt="p", stop="\n", temperature=0.5, seed=7,
                              extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2,
                                          "ignore_eos": True, "skip_special_tokens": False}, user="u1")
    assert bridge.calls[-1]["sampling"] == {"temperature": 0.5, "seed": 7, "stop": ["\n"], "top_k": 5,
                                            "min_p": 0.1,
                                            "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                                            "skip_special_tokens": False, "max_tokens": 16}  # OpenAI's default
    assert bridge.calls[-1]["prompt"] == "p" and not bridge.calls[-1]["logprobs"]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, max_completion_tokens=9,
                                   logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=0.25,
                                   response_format={"type": "text"})
    call = bridge.calls[-1]
    assert call["sampling"] == {"max_tokens": 9, "logprobs": 2, "presence_penalty": 0.5,
                                "frequency_penalty": 0.25}
    assert call["messages"] == msgs and call["logprobs"]
    client.chat.completions.create(model=MODEL, messages=msgs)
    assert bridge.calls[-1]["sampling"] == {}  # a chat runs to a stop or the context's end, as OpenAI's


def test_token_controls_are_forwarded(bridge, client):
    bridge.script = [done("ok")]
    controls = {"allowed_token_ids": [5, 6], "bad_words": ["no"], "include_stop_str_in_output": True,
                "truncate_prompt_tokens": 4}
    client.completions.create(model=MODEL, prompt="p", logit_bias={"42": 5, "7": -100}, extra_body=controls)
    assert bridge.calls[-1]["sampling"] == {"logit_bias": {"42": 5, "7": -100}, **controls, "max_tokens": 16}
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logit_bias={"3": 1},
                                   extra_body=controls)
    assert bridge.calls[-1]["sampling"] == {"logit_bias": {"3": 1}, **controls}


def test_health_follows_the_model(bridge):
    with urllib.request.urlopen(bridge.base + "/health") as r:
        assert r.status == 200
    bridge.ready = False
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bridge.base + "/health")
    assert e.value.code == 503


def test_n_choices_and_best_of_reach_the_model(bridge):
    """Several choices: each delta lands in its own choice; best_of > n asks the model for one final response."""
    bridge.script = [Delta("a", 1, 4, index=1), Delta("b", 1, None, index=0), Delta("c", 1, None, "length", index=1),
                     Delta("", 0, None, "stop", index=0)]
    status, body = post(bridge, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2})
    got = json.loads(body)
    assert status == 200 and [(c["index"], c["text"], c["finish_reason"]) for c in got["choices"]] == [
        (0, "b", "stop"), (1, "ac", "length")]
    assert got["usage"]["completion_tokens"] == 3 and bridge.calls[-1]["sampling"]["n"] == 2
    assert bridge.calls[-1]["deltas"] is True
    post(bridge, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "best_of": 3})
    assert bridge.calls[-1]["deltas"] is False and bridge.calls[-1]["sampling"]["best_of"] == 3
