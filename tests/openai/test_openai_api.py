"""The OpenAI-compatible front end, end to end: the official `openai` SDK (and raw HTTP where the exact bytes
matter) against `pagedllm serve --openai-port`, which runs a real tritonserver with the tiny random Llama and
starts the front end beside it. Every test runs twice: with the front end over the model's engine channel (as
`pagedllm serve` runs it) and through Triton's HTTP endpoint (`--engine-arg openai_channel=null`). One server per
way; its last test stops it with SIGTERM (the front end drains first, then Triton) and checks that nothing it
started is left."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import psutil
import pytest
import triton_server
from pagedllm.net import free_ports
from transformers import AutoTokenizer

pytestmark = [pytest.mark.server]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ENGINE = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 16,
          "chat_template": CHATML}
MODEL = "pagedllm"
PROMPT = "def main():"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
LONG = {"ignore_eos": True}  # the random model may sample EOS early: token counts must be exact


@dataclass
class Served(triton_server.Server):
    openai_port: int = 0
    over_channel: bool = True

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"


@pytest.fixture(scope="module", params=["engine-channel", "triton-http"])
def served(request, llama_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    http, grpc, metrics, port = free_ports(4)
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", llama_dir, "--workdir", str(work),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--openai-port", str(port), "--drain-timeout", "20"]
    engine = ENGINE if request.param == "engine-channel" else {**ENGINE, "openai_channel": None}
    cmd += [a for k, v in engine.items() for a in ("--engine-arg", f"{k}={json.dumps(v)}")]
    log = work / "serve.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    server = Served(proc, http, grpc, metrics, log, port, request.param == "engine-channel")
    deadline = time.monotonic() + 300
    while not _health_ok(server):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.3)
    yield server
    if proc.poll() is None:  # the last test did not get to stop it
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def _health_ok(server) -> bool:
    try:
        with urllib.request.urlopen(server.base + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def post_raw(server, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_prompt_tokens(tokenizer) -> int:
    text = tokenizer.apply_chat_template(MESSAGES, chat_template=CHATML, tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# --- discovery ---------------------------------------------------------------------------------------------

def test_health_and_models(served, client):
    assert _health_ok(served)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL


def test_the_front_end_reaches_the_model_the_way_serve_chose(served):
    front_end = [p for p in psutil.Process(served.proc.pid).children(recursive=True)
                 if "openai" in " ".join(p.cmdline())]
    assert len(front_end) == 1
    args = front_end[0].cmdline()
    if served.over_channel:
        socket_path = args[args.index("--engine-channel") + 1]
        assert f"engine channel for the OpenAI front end at {socket_path}" in served.log.read_text()
        assert oct(os.stat(socket_path).st_mode & 0o777) == oct(0o600)
    else:
        assert "--engine-channel" not in args and "engine channel" not in served.log.read_text()


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)


# --- completions -------------------------------------------------------------------------------------------

def test_completion_usage_is_exact(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                    extra_body=LONG)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    assert out.usage.completion_tokens == 12 == len(choice.logprobs.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_streamed_equals_not_streamed(client):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "extra_body": LONG}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[-2:-1]] == ["length"]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_a_stream_interval_streams_runs_of_tokens(client):
    """vLLM's stream_interval (extra body): the first token, then a chunk per 5 tokens, the rest with the last."""
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    whole = client.completions.create(**kw, extra_body=LONG)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                            extra_body={**LONG, "stream_interval": 5}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == whole.choices[0].text and 1 < len(texts) <= 4  # tokens 1, 6, 11 and 16
    assert chunks[-1].usage.completion_tokens == 16


def test_completion_logprobs_shape(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body=LONG)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and logprob <= 0  # the top 2 and the sampled token (tokens may decode alike)
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely


def test_stop_string(client):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "extra_body": LONG}
    free = client.completions.create(**kw, logprobs=0)
    text, tokens = free.choices[0].text, free.choices[0].logprobs.tokens
    stop = next(t for t in tokens[3:] if t.strip() and "\ufffd" not in t)
    stopped = client.completions.create(**kw, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.usage.completion_tokens < 24


def test_seeded_sample_is_reproduced(client):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 1234,
          "extra_body": LONG}
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first
    streamed = client.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == first


# --- chat ----------------------------------------------------------------------------------------------------

def test_chat_not_streamed(client, tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10,
                                         temperature=0, extra_body=LONG)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == chat_prompt_tokens(tokenizer)
    assert out.usage.completion_tokens == 10


def test_chat_streamed(client):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "extra_body": LONG}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = [c.choices[0].delta.content for c in chunks[1:-2]]
    assert all(content) and "".join(content) == whole.choices[0].message.content
    finish = chunks[-2].choices[0]
    assert finish.finish_reason == "length" and not finish.delta.content
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_stop_list_and_logprobs(client):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "extra_body": LONG}
    free = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    content = free.choices[0].logprobs.content
    assert len(content) == free.usage.completion_tokens == 24
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob == pytest.approx(tops[0])
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    text = free.choices[0].message.content
    stop = next(e.token for e in content[3:] if e.token.strip() and "\ufffd" not in e.token)
    stopped = client.chat.completions.create(**kw, stop=["<never>", stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_concurrent_requests_each_get_their_own_stream(client):
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0, "extra_body": LONG}
    prompts = [f"def f{i}():" for i in range(8)]
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    def one(i: int) -> str:
        if i % 2:
            return client.completions.create(prompt=prompts[i], **kw).choices[0].text
        chunks = client.completions.create(prompt=prompts[i], stream=True, **kw)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == alone


# --- several choices ---------------------------------------------------------------------------------------

def test_n_choices_streamed_and_not_equal_the_seeded_samples(client):
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 1.0, "seed": 21, "n": 3}
    whole = client.completions.create(prompt=PROMPT, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2] and len({c.text for c in whole.choices}) == 3
    first = client.completions.create(prompt=PROMPT, **{**kw, "n": 1}).choices[0].text
    assert whole.choices[0].text == first  # sample 0 draws with the request's seed
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(prompt=PROMPT, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in whole.choices]
    fixed = client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **kw)
    assert fixed.usage.completion_tokens == 3 * 12  # usage counts every choice's tokens
    chat = client.chat.completions.create(messages=MESSAGES, **kw)
    assert [c.index for c in chat.choices] == [0, 1, 2] and all(c.message.role == "assistant" for c in chat.choices)
    best = client.completions.create(prompt=PROMPT, **{**kw, "n": 1, "best_of": 3})
    assert len(best.choices) == 1 and best.choices[0].text in {c.text for c in whole.choices}


# --- errors --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    (b'{"model": "pagedllm", "prompt": ', None),  # malformed JSON
    (b"[1, 2]", None),  # not an object
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),  # a wrong type
    ({"model": MODEL, "prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "frobnicate": 1}, "frobnicate"),  # an unknown field
    ({"model": MODEL, "prompt": PROMPT, "n": 0}, "n"),  # refused by the model
    ({"model": MODEL, "prompt": PROMPT, "n": 3, "best_of": 2}, "best_of"),
    ({"model": MODEL, "prompt": PROMPT, "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"model": MODEL, "prompt": PROMPT, "logit_bias": {"42": 500}}, "logit_bias"),  # out of [-100, 100]
    ({"model": MODEL, "prompt": PROMPT, "echo": True}, "echo"),
    ({"model": MODEL, "prompt": PROMPT, "suffix": "x"}, "suffix"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL, "prompt": PROMPT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"model": MODEL, "prompt": PROMPT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    # an invalid schema, refused by the model's grammar compiler
    ({"model": MODEL, "prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format.json"),
    ({"prompt": PROMPT}, "model"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": -1}, "temperature"),  # refused by the model itself
    ({"model": MODEL, "prompt": PROMPT, "stream_interval": 0}, "stream_interval"),
    # a stream's status, decided before its first token
    ({"model": MODEL, "prompt": PROMPT, "top_k": -5, "stream": True}, "top_k"),
])
def test_bad_completion_requests_are_openai_400s(served, body, param):
    status, got = post_raw(served, "/v1/completions", body)
    assert status == 400, got
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["code"] is None
    assert got["error"]["param"] == param and got["error"]["message"]


@pytest.mark.parametrize("extra, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),  # refused by the model
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 500}, "top_logprobs"),  # over the model's max_logprobs
])
def test_bad_chat_requests_are_openai_400s(served, extra, param):
    status, got = post_raw(served, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **extra})
    assert status == 400 and got["error"]["param"] == param, got
    assert got["error"]["type"] == "invalid_request_error"


def test_the_sdk_raises_bad_request(client):
    for kw in ({"n": 0}, {"logit_bias": {"42": 500}}, {"max_tokens": "many"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, **kw)
        assert e.value.status_code == 400 and e.value.param == next(iter(kw))


# --- disconnects ---------------------------------------------------------------------------------------

def _send(served, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", served.openai_port), timeout=60)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _assert_cancelled_and_freed(served, before: dict) -> None:
    cancelled = before.get("pagedllm:requests_cancelled_total", 0) + 1
    m = served.wait_metrics(lambda m: served.all_blocks_free(m)
                            and m.get("pagedllm:requests_cancelled_total") == cancelled, timeout=30)
    assert m.get("pagedllm:requests_cancelled_total") == cancelled, m  # Triton cancelled it: it did not finish
    assert served.all_blocks_free(m) and m["pagedllm:kv_cache_usage_perc"] == 0, m


def test_disconnect_mid_stream_cancels_and_frees_every_block(served):
    before = served.scrape()
    s = _send(served, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000,
                                                "stream": True, **LONG})
    got = b""
    while got.count(b"data: ") < 3:  # the role chunk and some content: it is streaming
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    s.close()
    _assert_cancelled_and_freed(served, before)


def test_a_disconnect_storm_cancels_the_requests_and_the_next_one_is_served(served, client):
    """40 streams (more than max_num_seqs: some wait in the queue), each client leaving at its first token.
    Each request ends cancelled, or, where its client thread was slow to leave on a loaded host, at its length
    (the tiny model streams 2,000 tokens in about a second); most must be cancelled."""
    cancelled = "pagedllm:requests_cancelled_total"
    finished = 'pagedllm:request_success_total{finished_reason="length"}'
    before = served.scrape()

    def leave_at_first_token(i: int) -> None:
        s = _send(served, "/v1/completions", {"model": MODEL, "prompt": f"def f{i}():", "max_tokens": 2000,
                                              "stream": True, **LONG})
        got = b""
        while b"data: {" not in got:
            got += s.recv(4096)
        s.close()

    with ThreadPoolExecutor(40) as pool:
        list(pool.map(leave_at_first_token, range(40)))

    def ended(m: dict) -> dict:
        return {k: m.get(k, 0) - before.get(k, 0) for k in (cancelled, finished)}

    m = served.wait_metrics(lambda m: served.all_blocks_free(m) and sum(ended(m).values()) == 40, timeout=30)
    assert served.all_blocks_free(m) and sum(ended(m).values()) == 40 and ended(m)[cancelled] >= 30, ended(m)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=LONG)
    assert reply.usage.completion_tokens == 8


def test_disconnect_while_waiting_for_a_whole_completion_cancels_it(served):
    before = served.scrape()
    s = _send(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, **LONG})
    m = served.wait_metrics(lambda m: m.get("pagedllm:num_requests_running") == 1, timeout=30)
    assert m.get("pagedllm:num_requests_running") == 1
    s.close()
    _assert_cancelled_and_freed(served, before)


def test_disconnect_while_waiting_for_a_ranked_completion_cancels_it(served):
    """best_of > n: the model answers once, at the end. Through Triton nothing is written to the connection
    until then: the heartbeat the front end asks for is what lets Triton see the client leave. Over the engine
    channel the front end sends `cancel`."""
    before = served.scrape()
    s = _send(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "n": 1,
                                           "best_of": 2, "temperature": 1.0, **LONG})
    m = served.wait_metrics(lambda m: m.get("pagedllm:num_requests_running") == 2, timeout=30)
    assert m.get("pagedllm:num_requests_running") == 2  # both samples run
    s.close()
    _assert_cancelled_and_freed(served, before)


def test_a_client_leaving_while_its_request_is_queued_cancels_it_before_it_runs(served):
    """max_num_seqs streams hold every slot; the next request waits, its client leaves, and it is cancelled
    before it is admitted: its long prompt is never prefilled."""
    before = served.scrape()
    holders = [_send(served, "/v1/completions", {"model": MODEL, "prompt": f"def f{i}():", "max_tokens": 2000,
                                                 "stream": True, **LONG}) for i in range(ENGINE["max_num_seqs"])]
    queued_prompt = " ".join(f"word{i}" for i in range(300))
    try:
        m = served.wait_metrics(lambda m: m.get("pagedllm:num_requests_running") == ENGINE["max_num_seqs"])
        queued = _send(served, "/v1/completions", {"model": MODEL, "prompt": queued_prompt, "max_tokens": 4,
                                                    "stream": True, **LONG})
        m = served.wait_metrics(lambda m: m.get("pagedllm:num_requests_waiting") == 1, timeout=10)
        assert m.get("pagedllm:num_requests_waiting") == 1, m
        queued.close()
        cancelled = before.get("pagedllm:requests_cancelled_total", 0) + 1
        m = served.wait_metrics(lambda m: m.get("pagedllm:requests_cancelled_total") == cancelled, timeout=10)
        assert m.get("pagedllm:requests_cancelled_total") == cancelled and m["pagedllm:num_requests_waiting"] == 0
    finally:
        for h in holders:
            h.close()
    m = served.wait_metrics(lambda m: served.all_blocks_free(m), timeout=30)
    assert served.all_blocks_free(m)
    prefilled = m["pagedllm:prompt_tokens_total"] - before.get("pagedllm:prompt_tokens_total", 0)
    assert prefilled < 300, prefilled  # the holders' short prompts only


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- lifecycle (last: it stops the server) -------------------------------------------------------------

def test_response_format_json_schema_is_followed(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for seed in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed,
                                               max_tokens=64, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop"
        got = json.loads(reply.choices[0].message.content)
        assert set(got) == {"n", "ok"} and 0 <= got["n"] <= 99 and isinstance(got["ok"], bool)
    text = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=1, max_tokens=64,
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert text.finish_reason == "length" or isinstance(json.loads(text.text, strict=False), dict)


def test_sigterm_drains_the_front_end_first_then_everything_stops(served, client):
    assert f"OpenAI-compatible API at {served.base}/v1" in served.log.read_text()  # the banner
    family = psutil.Process(served.proc.pid).children(recursive=True)  # tritonserver, its stubs, the front end
    assert any("openai" in " ".join(p.cmdline()) for p in family)
    chunks, errors = [], []

    def stream() -> None:
        try:
            for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body=LONG):
                chunks.append(c)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    served.proc.send_signal(signal.SIGTERM)
    at_signal = len(chunks)
    reader.join(120)
    # The request in flight ran to its end: the front end drained while Triton still served it.
    assert not errors and chunks[-1].usage.completion_tokens == 1500 and len(chunks) > at_signal + 2
    drained = time.monotonic()
    assert served.proc.wait(120) == 0
    # Triton had nothing left to wait for: no request, and no stream left holding the model (see triton_bridge).
    assert "Exit timeout expired" not in served.log.read_text() and time.monotonic() - drained < 15
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in family):
        assert time.monotonic() < deadline, [p.pid for p in family if _alive(p)]
        time.sleep(0.1)
    with pytest.raises(OSError):
        http.client.HTTPConnection("127.0.0.1", served.openai_port, timeout=2).request("GET", "/health")

