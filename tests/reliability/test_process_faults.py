"""Processes that die or are told to stop, with requests in flight.

- A tensor-parallel worker killed under load: the in-flight requests get a clear error naming the dead rank,
  the model reports NOT READY, loads itself again (new workers) and serves again.
- SIGTERM to `pagedllm serve` during streams: each stream finishes or gets a clear error, and afterwards no
  process that it started (tritonserver, the Python-backend stub, tensor-parallel workers) is alive, checked
  against the process table. A second signal stops everything at once. A signal while `serve` still starts
  (tritonserver already serving, the OpenAI front end not yet up) drains tritonserver all the same.
- Every socket those processes listen on is on loopback, unless `--host` says otherwise.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import triton_server
from conftest import wait_for
from pagedllm import LLM, SamplingParams
from pagedllm.net import free_ports
from serving_client import grpc_call, grpc_inputs, post

pytestmark = [pytest.mark.server, pytest.mark.slow]

TP = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 8 << 20, "tensor_parallel_size": 2,
      "engine_restart_backoff_s": 0.2}
STREAM = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
PROMPTS = ["def main():", "import os", "class Foo:"]


def workers_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "pagedllm.engine.executor.worker_main" in " ".join(p.cmdline())]


def alive(procs) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_killed_worker_fails_in_flight_requests_then_the_model_comes_back(llama_dir, tmp_path):
    reference = LLM(llama_dir, dtype="float32", max_model_len=512).generate(
        PROMPTS, SamplingParams(**STREAM), use_tqdm=False)
    server = triton_server.start(tmp_path, llama_dir, TP)
    try:
        (worker,) = workers_of(server.proc.pid)
        results: dict = {}
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(
            p, grpc_call(server, grpc_inputs(p, STREAM, stream=True)))) for p in PROMPTS]
        for t in threads:
            t.start()
        server.wait_metrics(lambda m: m.get("pagedllm:num_requests_running", 0) == len(PROMPTS), timeout=60)
        worker.kill()
        for t in threads:
            t.join(120)
        for p in PROMPTS:
            text, err = results[p]
            assert err is not None and "tensor-parallel worker died" in err and f"pid {worker.pid}" in err, err
        deadline = time.monotonic() + 240
        new_workers = []
        while not new_workers:  # the model loads itself again, with new workers
            assert time.monotonic() < deadline
            time.sleep(0.2)
            new_workers = [w for w in workers_of(server.proc.pid) if w.pid != worker.pid]
        for p, ref in zip(PROMPTS, reference):
            text, err = "", "not ready yet"
            while err is not None and time.monotonic() < deadline:
                text, err = grpc_call(server, grpc_inputs(p, STREAM, stream=True))
            assert (text, err) == (ref.outputs[0].text, None)
        m = server.wait_metrics(lambda m: m.get("pagedllm:engine_restarts_total") == 1 and server.all_blocks_free(m))
        assert m["pagedllm:engine_restarts_total"] == 1 and server.all_blocks_free(m)
        assert not alive([worker])
    finally:
        triton_server.stop(server)


def _serve(llama_dir, tmp_path, drain_timeout: int, tp: int = 2, host: str = "127.0.0.1",
           until_banner: bool = True):
    """`pagedllm serve` in a subprocess; returns once it prints its banner (it is serving on every port), or with
    `until_banner=False` as soon as tritonserver answers, which may be before the OpenAI front end is up."""
    ports = free_ports(4)  # HTTP, gRPC, metrics, and the OpenAI front end `serve` starts too
    engine_args = ["--engine-arg", "dtype=\"float32\"", "--engine-arg", "max_model_len=512",
                   "--engine-arg", f"kv_cache_memory_bytes={8 << 20}", "--engine-arg", f"tensor_parallel_size={tp}"]
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", llama_dir, "--workdir", str(tmp_path / "w"),
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]), "--drain-timeout", str(drain_timeout), "--host", host, *engine_args]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = triton_server.Server(proc, *ports[:3], tmp_path / "serve.log")
    server.openai = ports[3]
    deadline = time.monotonic() + 240
    # `serve` starts the front end once the model is ready, then prints the banner. A client that sees both answer
    # may still be ahead of `serve` itself, which is then still waiting for the front end.
    while not (_banner(tmp_path) if until_banner else _status(server) == 200):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
        time.sleep(0.1 if not until_banner else 0.5)
    return proc, server


def _banner(tmp_path) -> bool:
    return b"pagedllm is serving" in (tmp_path / "serve.log").read_bytes()


def _status(server) -> int:
    try:
        return post(server, "generate", {"text_input": "x", "max_tokens": 1}, timeout=10)[0]
    except OSError:  # not listening yet
        return 0


def _started_by(proc) -> list[psutil.Process]:
    return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (ip.ipv4_mapped or ip).is_loopback if ip.version == 6 else ip.is_loopback


def _listening(family) -> dict[int, str]:
    """port -> address of every TCP socket the processes listen on."""
    return {c.laddr.port: c.laddr.ip for p in family for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


@pytest.fixture
def cleanup():
    """Processes to kill when the test ends, whatever happened (a failed assertion must not leave a server)."""
    families: list = []
    yield families
    for family in families:
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_sigterm_drains_streams_and_leaves_no_process_behind(llama_dir, tmp_path, cleanup):
    proc, server = _serve(llama_dir, tmp_path, drain_timeout=60)
    family = _started_by(proc)
    cleanup.append(family)
    names = " ".join(p.name() for p in family)
    assert "tritonserver" in names and "triton_python_backend_stub" in names and len(workers_of(proc.pid)) == 1
    listening = _listening(family)  # the Triton ports, the OpenAI front end's, the tensor-parallel store, gloo's
    assert {server.http, server.grpc, server.metrics, server.openai} <= set(listening) and len(listening) > 4, listening
    assert all(_loopback(address) for address in listening.values()), listening
    reference = LLM(llama_dir, dtype="float32", max_model_len=512).generate(
        PROMPTS, SamplingParams(**STREAM), use_tqdm=False)
    results: dict = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(
        p, grpc_call(server, grpc_inputs(p, STREAM, stream=True)))) for p in PROMPTS]
    for t in threads:
        t.start()
    server.wait_metrics(lambda m: m.get("pagedllm:num_requests_running", 0) >= 1, timeout=60)
    os.kill(proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert proc.wait(120) == 0
    for p, ref in zip(PROMPTS, reference):
        text, err = results[p]
        assert (text, err) == (ref.outputs[0].text, None) or (err and "StatusCode" in err), results[p]
    wait_for(lambda: not alive(family), timeout=30)
    assert not alive(family)


def test_a_second_signal_stops_everything_at_once(llama_dir, tmp_path, cleanup):
    proc, server = _serve(llama_dir, tmp_path, drain_timeout=600, tp=1, host="0.0.0.0")
    family = _started_by(proc)
    cleanup.append(family)
    listening = _listening(family)
    ports = (server.http, server.grpc, server.metrics, server.openai)
    assert all(listening.get(port) in ("0.0.0.0", "::") for port in ports), listening
    # An idle keep-alive HTTP connection holds tritonserver's drain open until its exit timeout (600 s here).
    idle = http.client.HTTPConnection("127.0.0.1", server.http, timeout=30)
    idle.request("GET", "/v2/health/live")
    idle.getresponse().read()
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(2)
    assert proc.poll() is None  # draining
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 0  # at once, not after the 600 s drain
    wait_for(lambda: not alive(family), timeout=30)
    idle.close()


def test_a_signal_while_the_front_end_starts_still_drains_tritonserver(llama_dir, tmp_path, cleanup):
    """SIGTERM as soon as tritonserver serves, most often while `serve` still waits for its OpenAI front end:
    tritonserver, which may have requests in flight, drains (an idle keep-alive connection holds it open) rather
    than being killed with the front end. A second signal then ends it."""
    proc, server = _serve(llama_dir, tmp_path, drain_timeout=600, tp=1, until_banner=False)
    family = _started_by(proc)
    cleanup.append(family)
    idle = http.client.HTTPConnection("127.0.0.1", server.http, timeout=30)
    idle.request("GET", "/v2/health/live")
    idle.getresponse().read()
    os.kill(proc.pid, signal.SIGTERM)
    log = tmp_path / "serve.log"
    wait_for(lambda: b"HTTP service connections" in log.read_bytes() or proc.poll() is not None, timeout=60)
    assert proc.poll() is None, log.read_text()[-3000:]  # tritonserver is draining, held by the idle connection
    family += [p for p in _started_by(proc) if p not in family]  # the front end, if it had started
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 0
    wait_for(lambda: not alive(family), timeout=30)
    idle.close()
