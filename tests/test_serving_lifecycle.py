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
    server = triton_server.start(tmp_path, llama_dir, ENGINE,
                                 extra_args=["--model-control-mode=explicit", "--load-model=pagedllm"])
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
