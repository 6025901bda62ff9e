"""Soak test through the real tritonserver on loopback: concurrent users for minutes, each looping over a mix of
streaming (SSE and gRPC), non-streaming, cancelled-mid-stream and malformed requests.

Reports unexpected failures (target 0: a good request that did not complete, a malformed one that did not get a
400), KV blocks still held once the load stops (target 0), the Python-backend stub's resident memory after the
warm-up and at the end, TTFT p50/p99 of the streams, and requests per kind. Exits 1 if anything failed or
leaked.

The warm-up first writes every KV block (long prompts whose tokens add up to more than the pool holds) and then
runs the mixed load for a while, so that the caches that grow with the shapes a server meets have met most of
them: growth after it is what the process keeps, not what it was still learning.

    .venv/bin/python perf/soak.py                                   # 32 users, 5 minutes, small Llama (bf16)
    .venv/bin/python perf/soak.py --users 8 --minutes 0.5 --size tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np
import psutil
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput

from common import emit, model_dir, pct
from pagedllm.serving import launcher

ENGINE = {"dtype": "bfloat16", "max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 64}
MODEL = "pagedllm"
WORDS = ["def", "class", "import", "return", "self", "value", "print", "for", "while", "if", "else", "data",
         "list", "dict", "name", "result", "open", "file", "with", "as", "lambda", "yield", "async", "await"]
# Requests the server must refuse with a 400 (HTTP generate): bad JSON, unknown or out-of-range parameters.
MALFORMED = [
    b'{"text_input": "hi", "sampling_parameters": "{\\"max_tokens\\": 8,"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"temperature\\": -1}"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"max_tokens\\": 8, \\"stop_token_ids\\": [100000000]}"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"top_p\\": 7}"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"no_such_parameter\\": 1}"}',
    b'{"text_input": "", "max_tokens": 8}',
    b'{"text_input": "hi", "sampling_parameters": "' + b"[" * 200 + b'"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"max_tokens\\": 1' + b"0" * 400 + b'}"}',
    b'{"text_input": "hi", "max_tokens": 8, "beam_width": 4}',
    b'{"sampling_parameters": "{}"}',
]
KINDS = {"sse": 0.3, "grpc": 0.25, "generate": 0.2, "cancel": 0.15, "malformed": 0.1}


class Stats:
    def __init__(self) -> None:
        self.done: Counter = Counter()
        self.failures: list[str] = []
        self.ttft: list[float] = []

    def fail(self, kind: str, what: str) -> None:
        self.failures.append(f"{kind}: {what}"[:300])


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))


async def sse(session, base, rng, stats, cancel=False) -> None:
    body = {"text_input": prompt(rng), "stream": True, "max_tokens": rng.randint(8, 128), "temperature": 0.7,
            "top_p": 0.95, "seed": rng.randint(0, 2 ** 63)}
    start = time.perf_counter()
    async with session.post(f"{base}/v2/models/{MODEL}/generate_stream", json=body) as r:
        if r.status != 200:
            stats.fail("sse", f"HTTP {r.status}: {await r.text()}")
            return
        events = 0
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                stats.fail("sse", event["error"])
                return
            if events == 0:
                stats.ttft.append(time.perf_counter() - start)
            events += 1
            if cancel:  # disconnect mid-stream: the server must cancel and free the request's blocks
                r.close()
                return
        if events == 0:
            stats.fail("sse", "no event")


async def grpc_stream(client, rng, stats, cancel=False) -> None:
    text = InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt(rng).encode()], dtype=np.object_))
    max_tokens = InferInput("max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([rng.randint(8, 128)], dtype=np.int32))
    stream = InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))

    async def requests():
        yield {"model_name": MODEL, "inputs": [text, max_tokens, stream]}

    start, got = time.perf_counter(), 0
    responses = client.stream_infer(inputs_iterator=requests())
    async for result, error in responses:
        if error is not None:
            stats.fail("grpc", str(error))
            return
        if got == 0:
            stats.ttft.append(time.perf_counter() - start)
        got += 1
        if cancel:
            responses.cancel()
            return
        if result.get_response().parameters["triton_final_response"].bool_param:
            return
    if not got:
        stats.fail("grpc", "no response")


async def generate(session, base, rng, stats) -> None:
    body = {"text_input": prompt(rng), "max_tokens": rng.randint(8, 64), "temperature": 0}
    async with session.post(f"{base}/v2/models/{MODEL}/generate", json=body) as r:
        data = await r.text()
        if r.status != 200 or "text_output" not in json.loads(data):
            stats.fail("generate", f"HTTP {r.status}: {data}")


async def malformed(session, base, rng, stats) -> None:
    payload = rng.choice(MALFORMED)
    async with session.post(f"{base}/v2/models/{MODEL}/generate", data=payload) as r:
        text = await r.text()
        if r.status != 400:
            stats.fail("malformed", f"expected 400, got {r.status}: {text} for {payload[:80]!r}")


async def user(seed: int, base: str, grpc_url: str, deadline: float, stats: Stats) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = grpcaio.InferenceServerClient(grpc_url)
        try:
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                try:
                    if kind == "sse":
                        await sse(session, base, rng, stats)
                    elif kind == "grpc":
                        await grpc_stream(client, rng, stats)
                    elif kind == "generate":
                        await generate(session, base, rng, stats)
                    elif kind == "cancel":
                        await (sse(session, base, rng, stats, cancel=True) if rng.random() < 0.5
                               else grpc_stream(client, rng, stats, cancel=True))
                    else:
                        await malformed(session, base, rng, stats)
                    stats.done[kind] += 1
                except Exception as e:  # a transport error is a failure too
                    stats.fail(kind, f"{type(e).__name__}: {e}")
        finally:
            await client.close()


def stub_memory(server_pid: int) -> dict[str, float]:
    """The stub's resident memory in MiB: all of it, and its anonymous, file-backed and shared parts."""
    (stub,) = [p for p in psutil.Process(server_pid).children(recursive=True)
               if "triton_python_backend_stub" in p.name()]
    fields = {}
    with open(f"/proc/{stub.pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


async def run_load(base: str, grpc_url: str, users: int, seconds: float, stats: Stats,
                   sample=None) -> None:
    deadline = time.monotonic() + seconds

    async def sampler():
        while time.monotonic() < deadline:
            await asyncio.sleep(min(30.0, max(0.0, deadline - time.monotonic())))
            sample()

    tasks = [user(i, base, grpc_url, deadline, stats) for i in range(users)]
    await asyncio.gather(*tasks, *([sampler()] if sample else []))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=30.0, help="load before the first RSS reading")
    ap.add_argument("--size", default="small", help="tiny_model size")
    args = ap.parse_args()
    path = model_dir("llama", args.size, "bfloat16")
    with tempfile.TemporaryDirectory() as work:
        server = launcher.launch_on_free_ports(Path(work), path, ENGINE)
        try:
            return soak(server, args)
        finally:
            launcher.stop_server(server.proc)


async def fill_pool(base: str, tokens: int) -> None:
    """Prefill distinct long prompts, 8 at a time, until more tokens than the KV pool holds were written."""
    rng = random.Random(99)
    async with aiohttp.ClientSession() as session:
        async def one():
            body = {"text_input": " ".join(rng.choice(WORDS) for _ in range(800)), "max_tokens": 1}
            async with session.post(f"{base}/v2/models/{MODEL}/generate", json=body) as r:
                await r.read()

        for _ in range(0, tokens, 8 * 800):
            await asyncio.gather(*(one() for _ in range(8)))


def soak(server, args) -> int:
    base, grpc_url = f"http://127.0.0.1:{server.http_port}", f"127.0.0.1:{server.grpc_port}"
    stats = Stats()
    blocks = wait_idle(server.metrics_port)["pagedllm:kv_blocks_total"]
    asyncio.run(fill_pool(base, int(1.2 * blocks * 16)))  # 16: the block size
    warmup = min(args.warmup_s, 0.2 * args.minutes * 60)
    asyncio.run(run_load(base, grpc_url, args.users, warmup, stats))
    start = stub_memory(server.proc.pid)
    timeline = [start["VmRSS"]]  # every 30 s under load
    t0 = time.monotonic()
    asyncio.run(run_load(base, grpc_url, args.users, args.minutes * 60 - warmup, stats,
                         sample=lambda: timeline.append(stub_memory(server.proc.pid)["VmRSS"])))
    elapsed = time.monotonic() - t0 + warmup
    metrics = wait_idle(server.metrics_port)
    end = stub_memory(server.proc.pid)
    rss_start, rss_end = start["VmRSS"], end["VmRSS"]
    leaked = metrics["pagedllm:kv_blocks_total"] - metrics["pagedllm:kv_blocks_free"]
    summary = {
        "bench": "soak", "users": args.users, "seconds": round(elapsed, 1), "model": f"llama-{args.size}",
        "requests": dict(stats.done), "unexpected_failures": len(stats.failures), "blocks_leaked": leaked,
        "running_after": metrics["pagedllm:num_requests_running"],
        "engine_restarts": metrics.get("pagedllm:engine_restarts_total", 0.0),
        "stub_rss_mib_after_warmup": rss_start, "stub_rss_mib_end": rss_end,
        "stub_rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2),
        "stub_memory_after_warmup": start, "stub_memory_end": end, "stub_rss_mib_every_30s": timeline,
        "ttft_p50_s": round(pct(stats.ttft, 0.5), 3), "ttft_p99_s": round(pct(stats.ttft, 0.99), 3),
    }
    emit(summary)
    for failure in stats.failures[:20]:
        print("FAILURE", failure)
    return 1 if stats.failures or leaked or metrics["pagedllm:num_requests_running"] else 0


def wait_idle(metrics_port: int, timeout: float = 30.0) -> dict[str, float]:
    """The engine's gauges once nothing runs or waits (cancelled streams finish within the sweep interval)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            values = {}
            for line in r.read().decode().splitlines():
                if line.startswith("pagedllm:") and "{" in line:
                    name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
                    if "finished_reason" not in line and "position" not in line:
                        values[name] = float(value)
        idle = values.get("pagedllm:num_requests_running") == 0 and values.get("pagedllm:num_requests_waiting") == 0
        if (idle and values["pagedllm:kv_blocks_free"] == values["pagedllm:kv_blocks_total"]) or \
                time.monotonic() > deadline:
            return values
        time.sleep(0.2)


if __name__ == "__main__":
    raise SystemExit(main())
