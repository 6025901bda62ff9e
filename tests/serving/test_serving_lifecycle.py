"""Model unload and reload through Triton's explicit model control while requests are in flight.

Triton itself drains a decoupled model's in-flight requests before it calls finalize(), so an unload lets
running streams finish; finalize() then aborts anything still queued and joins every thread."""

from __future__ import annotations

import threading

import pytest
import tritonclient.http as httpclient

import triton_server
from pagedllm_client import PagedLLMClient
from pagedllm_client.client import ServerError

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20}


def test_unload_with_requests_in_flight_then_reload(llama_dir, tmp_path):
    server = triton_server.start(tmp_path, llama_dir, ENGINE)
    try:
        outcomes: dict[int, object] = {}
        started = threading.Barrier(5)

        def stream(i):
            client = PagedLLMClient(server.grpc_url)
            try:
                result = client.generate(f"def f{i}():", max_tokens=300, ignore_eos=True,
                                         on_piece=lambda n: n == 2 and started.wait(timeout=60))
                outcomes[i] = result.num_output_tokens
            except ServerError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(timeout=60)  # all four are streaming
        http = httpclient.InferenceServerClient(server.http_url)
        http.unload_model("pagedllm")
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a stream hung across the unload"
        assert outcomes == {i: 300 for i in range(4)}  # drained, each to its full length
        assert not http.is_model_ready("pagedllm")

        http.load_model("pagedllm")
        assert http.is_model_ready("pagedllm")
        result = PagedLLMClient(server.grpc_url).generate("def g():", max_tokens=5, temperature=0)
        assert result.num_output_tokens == 5
        assert server.all_blocks_free(server.wait_metrics(server.all_blocks_free))
        http.close()
    finally:
        triton_server.stop(server)


def test_deadline_overload_and_priority_input_through_triton(tmp_path):
    import json

    import numpy as np

    from pagedllm.tiny_model import make_variant_model
    from serving_client import grpc_call, grpc_inputs

    # A must still hold the only slot when B's 5 s deadline passes: on a fast host the tiny model made its 2,000
    # tokens (its position limit) in under a second, so this one takes 16,384 positions (~30 s on 2 Zen 4 cores).
    # B's deadline leaves C time to arrive while B is still queued: with 1 s, a loaded CI host once scraped and
    # connected past it, so B had already timed out, C was admitted behind A and the refusal never came.
    model = make_variant_model(str(tmp_path / "llama-long"), max_position_embeddings=16384)
    engine = dict(ENGINE, max_model_len=16384, max_num_seqs=1, max_queue_size=1, scheduling_policy="priority")
    server = triton_server.start(tmp_path, model, engine)
    try:
        long_running = PagedLLMClient(server.grpc_url).stream("def main():", max_tokens=16000, ignore_eos=True)
        next(long_running)  # A holds the only sequence slot
        results = {}

        def queued_with_deadline():
            inputs = grpc_inputs("import os", {"max_tokens": 5}, stream=False,
                                  timeout=(np.array([5.0], dtype=np.float32), "FP32"),
                                  priority=(np.array([3], dtype=np.int32), "INT32"),
                                  return_finish_reason=(np.array([True]), "BOOL"))
            results["b"] = grpc_call(server, inputs, outputs=("finish_reason",))

        b = threading.Thread(target=queued_with_deadline)
        b.start()
        queued = server.wait_metrics(lambda m: m.get("pagedllm:num_requests_waiting") == 1)
        assert queued.get("pagedllm:num_requests_waiting") == 1, "B never showed as queued"
        text, err = grpc_call(server, grpc_inputs("x", json.dumps({"max_tokens": 3})))
        assert err is not None and "overloaded" in err  # C: the queue (max_queue_size=1) holds B
        b.join(timeout=60)
        (text, err, extra) = results["b"]
        # B never started: the non-streaming response is the prompt alone, finished by its deadline
        assert err is None and extra["finish_reason"] == "timeout" and text == "import os"
        long_running.close()  # the client cancels A
        assert server.all_blocks_free(server.wait_metrics(server.all_blocks_free))
    finally:
        triton_server.stop(server)


def test_speculative_decoding_through_triton(llama_dir, tmp_path):
    from pagedllm import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    server = triton_server.start(tmp_path, llama_dir, dict(ENGINE, speculative_config=spec))
    try:
        prompt = "def main():\n    return main()\n" * 3
        got = PagedLLMClient(server.grpc_url).generate(prompt, max_tokens=150, ignore_eos=True, temperature=0)
        offline = LLM(llama_dir, **dict(ENGINE, kv_cache_memory_bytes=16 << 20))
        want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
        assert got.text == want and got.num_output_tokens == 150
        m = server.wait_metrics(lambda m: m.get("pagedllm:spec_decode_num_draft_tokens_total", 0) > 0
                                and server.all_blocks_free(m))
        accepted = m["pagedllm:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= m["pagedllm:spec_decode_num_draft_tokens_total"]
        per_pos = sum(v for k, v in m.items() if k.startswith("pagedllm:spec_decode_num_accepted_tokens_per_pos"))
        assert per_pos == accepted
    finally:
        triton_server.stop(server)
