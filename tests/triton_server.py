"""Starts a real tritonserver (from the nvidia-pytriton wheel) serving pagedllm on free loopback ports."""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedllm.serving import launcher


@dataclass
class Server:
    proc: object
    http: int
    grpc: int
    metrics: int
    log: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def scrape(self) -> dict[str, float]:
        """pagedllm:* samples as {name: value}; labels other than model/version stay in the key, e.g.
        'pagedllm:request_success_total{finished_reason="stop"}' or 'pagedllm:iteration_tokens_count'."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(pagedllm:[a-z0-9_]+)(?:\{([^}]*)\})? ([0-9.e+-]+|\+Inf)$", line)
            if m:
                labels = [kv for kv in (m.group(2) or "").split(",") if kv and
                          not kv.startswith(("model=", "version="))]
                key = m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")
                out[key] = float(m.group(3))
        return out

    def wait_metrics(self, predicate, timeout: float = 30.0) -> dict[str, float]:
        """Poll until predicate(metrics) holds (the gauges are published every 100 ms)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.scrape()
            if predicate(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def all_blocks_free(self, m: dict[str, float] | None = None) -> bool:
        m = m if m is not None else self.scrape()
        # The gauges exist (at 0) before their first publication: a pool of 0 blocks is not yet published.
        return (m.get("pagedllm:kv_blocks_total", 0) > 0 and m.get("pagedllm:kv_blocks_free") == m.get("pagedllm:kv_blocks_total")
                and m.get("pagedllm:num_requests_running") == 0 and m.get("pagedllm:num_requests_waiting") == 0)


def start(workdir: Path, model_dir: str, engine_overrides: dict, extra_args: list[str] = (),
          config_overrides: str = "", explicit_model_control: bool = True) -> Server:
    run = launcher.launch_on_free_ports(workdir, model_dir, engine_overrides, extra_args, config_overrides,
                                        explicit_model_control=explicit_model_control)
    return Server(run.proc, run.http_port, run.grpc_port, run.metrics_port, run.log)


def stop(server: Server) -> None:
    launcher.stop_server(server.proc)


def server_fixture(engine_overrides: dict):
    """A module-scoped `server` fixture: one server of the tiny Llama with these engine settings, for every test
    of the module (`server = triton_server.server_fixture(ENGINE)`)."""

    @pytest.fixture(scope="module")
    def server(llama_dir, tmp_path_factory):
        s = start(tmp_path_factory.mktemp("triton"), llama_dir, engine_overrides)
        yield s
        stop(s)

    return server
