"""Locust users for pagedllm: SSE over HTTP generate_stream and gRPC streaming, each reporting TTFT and the
whole request as separate request types. Run through perf/load_tools.py locust (it sets the URLs)."""

from __future__ import annotations

import json
import os
import time

from gevent import monkey  # noqa: F401  (locust has patched already; gRPC needs its gevent hook next)
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # without this tritonclient.grpc hangs under locust

from locust import HttpUser, User, between, task  # noqa: E402

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = int(os.environ.get("PAGEDLLM_MAX_TOKENS", "64"))


def _fire(env, kind: str, name: str, seconds: float, length: int, exc=None) -> None:
    env.events.request.fire(request_type=kind, name=name, response_time=1000 * seconds, response_length=length,
                            exception=exc, context={})


class SSEUser(HttpUser):
    wait_time = between(0.0, 0.1)

    @task
    def generate_stream(self):
        body = {"text_input": PROMPT, "stream": True, "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({"max_tokens": MAX_TOKENS, "ignore_eos": True})}
        start, first, pieces = time.perf_counter(), None, 0
        # With stream=True locust times the POST to its headers only ("sse connect"); the whole stream is
        # reported as "sse total".
        with self.client.post("/v2/models/pagedllm/generate_stream", json=body, stream=True,
                              catch_response=True, name="sse connect") as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data:"):
                    if first is None:
                        first = time.perf_counter()
                        _fire(self.environment, "SSE", "ttft", first - start, 0)
                    pieces += 1
            if pieces == 0:
                resp.failure("no events")
        _fire(self.environment, "SSE", "sse total", time.perf_counter() - start, pieces,
              None if pieces else RuntimeError("no events"))


class GrpcUser(User):
    wait_time = between(0.0, 0.1)

    @task
    def stream(self):
        from pagedllm_client import PagedLLMClient

        client = PagedLLMClient(os.environ["PAGEDLLM_GRPC_URL"])
        start, first, pieces = time.perf_counter(), None, 0
        try:
            for _ in client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True):
                if first is None:
                    first = time.perf_counter()
                    _fire(self.environment, "gRPC", "ttft", first - start, 0)
                pieces += 1
            _fire(self.environment, "gRPC", "grpc total", time.perf_counter() - start, pieces)
        except Exception as e:  # reported to locust as a failure
            _fire(self.environment, "gRPC", "grpc total", time.perf_counter() - start, 0, e)
