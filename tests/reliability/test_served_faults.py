"""Faults injected inside the engine of a real tritonserver, under load.

- A per-request fault fails that request alone (INTERNAL, with the reason); the streams beside it finish with
  exactly their reference tokens.
- A forward fault fails every in-flight request once (UNAVAILABLE); under explicit model control (what
  `pagedllm serve` runs) the model reports NOT READY, loads itself again and serves again;
  `pagedllm:engine_restarts_total` counts it. Under model-control mode NONE the engine restarts in process.
- The server never crashes, and its log never shows a response sender used after its final response.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer

import triton_server
from pagedllm import LLM, SamplingParams
from serving_client import grpc_call, grpc_inputs

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 16,
          "engine_restart_backoff_s": 0.2}
STREAM = {"temperature": 0, "max_tokens": 120, "ignore_eos": True}
PROMPTS = ["def main():", "import os", "class Foo:", "x = [1, 2"]


def trigger_word(model_dir) -> tuple[str, int]:
    """A word whose token (with its leading space) none of PROMPTS holds: a prompt with it trips the fault."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    for word in ("return", "yield", "lambda", "while", "import"):
        ids = tok.encode(f"a {word}")
        if tok.decode(ids[-1:]) == f" {word}" and all(ids[-1] not in tok.encode(p) for p in PROMPTS):
            return f"please {word} now", ids[-1]
    pytest.fail("no single-token trigger word in this tokenizer")


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, **{k: v for k, v in ENGINE.items() if k != "engine_restart_backoff_s"})
    return {p: o.outputs[0].text for p, o in zip(
        PROMPTS, llm.generate(PROMPTS, SamplingParams(**STREAM), use_tqdm=False))}


def run_streams(server, prompts, results: dict, params: dict = STREAM) -> list[threading.Thread]:
    def one(p):
        results[p] = grpc_call(server, grpc_inputs(p, params, stream=True))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads


def wait_streaming(server, n: int) -> None:
    server.wait_metrics(lambda m: m.get("pagedllm:num_requests_running", 0) >= n, timeout=60)


def ready(server) -> int:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/pagedllm/ready", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def assert_clean_log(server) -> None:
    log = server.log.read_text()
    assert "Response sender has been closed" not in log and "after the final one" not in log
    assert "Signal (11)" not in log and server.proc.poll() is None


def test_a_per_request_fault_fails_that_request_alone(llama_dir, tmp_path, reference):
    word, token = trigger_word(llama_dir)
    server = triton_server.start(tmp_path, llama_dir, {**ENGINE, "fault_injection": {"point": "sample",
                                                                                     "token_id": token}})
    try:
        results: dict = {}
        threads = run_streams(server, PROMPTS, results)
        wait_streaming(server, 2)
        text, err = grpc_call(server, grpc_inputs(word, STREAM, stream=True))
        for t in threads:
            t.join(120)
        # (over a gRPC stream Triton forwards an error's message, not its code: INTERNAL here)
        assert err is not None and err.startswith("request failed: InjectedFault: injected sample fault"), err
        assert {p: r for p, r in results.items()} == {p: (reference[p], None) for p in PROMPTS}
        # A scrape can fall between a publish's gauges and its counters: wait for both (CI once read the error
        # counter at 0 with the blocks already free).
        errors = 'pagedllm:request_success_total{finished_reason="error"}'
        m = server.wait_metrics(lambda m: server.all_blocks_free(m) and m.get(errors) == 1)
        assert server.all_blocks_free(m) and m[errors] == 1
        assert m.get("pagedllm:engine_restarts_total", 0) == 0
        assert_clean_log(server)
    finally:
        triton_server.stop(server)


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit-reload", "none-in-process"])
def test_a_forward_fault_fails_in_flight_requests_then_the_engine_comes_back(llama_dir, tmp_path, reference,
                                                                              explicit):
    word, token = trigger_word(llama_dir)
    # The in-flight streams must still be running when the faulting request reaches a step: they ask for as many
    # tokens as the model's positions allow. (With 120 tokens one was seen to end first while other work shared
    # the 2 cores; with 480, once on a slow CI host.) The fault ends them, so the length costs no time.
    engine = {**ENGINE, "max_model_len": 2048, "fault_injection": {"point": "forward", "token_id": token}}
    server = triton_server.start(tmp_path, llama_dir, engine, explicit_model_control=explicit)
    try:
        results: dict = {}
        threads = run_streams(server, PROMPTS, results, {**STREAM, "max_tokens": 2000})
        wait_streaming(server, len(PROMPTS))
        _, err = grpc_call(server, grpc_inputs(word, STREAM, stream=True))
        states = [ready(server)]
        for t in threads:
            t.join(120)
        assert err is not None and "engine failed: InjectedFault: injected forward fault" in err, err
        for p in PROMPTS:  # each in-flight stream ended with exactly one clear error
            assert results[p][1] is not None and "engine failed" in results[p][1], results[p]
        deadline = time.monotonic() + 180
        while states[-1] != 200 or len(states) < 2:
            assert time.monotonic() < deadline, states[-20:]
            states.append(ready(server))
            time.sleep(0.02)
        if explicit:
            assert any(s != 200 for s in states), "the model never reported NOT READY while it was down"
        for p in PROMPTS:  # serving again, and right
            text, err = (None, "not ready")
            while time.monotonic() < deadline and err is not None:
                text, err = grpc_call(server, grpc_inputs(p, STREAM, stream=True))
            assert (text, err) == (reference[p], None)
        m = server.wait_metrics(lambda m: m.get("pagedllm:engine_restarts_total") == 1 and server.all_blocks_free(m))
        assert m["pagedllm:engine_restarts_total"] == 1 and server.all_blocks_free(m)
        assert_clean_log(server)
    finally:
        triton_server.stop(server)
