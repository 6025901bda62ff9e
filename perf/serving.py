"""Served throughput and latency under load: pagedllm through the real tritonserver, both ways a client reaches
it (Triton's own SSE `generate_stream`, and `pagedllm openai` in front of that Triton over the model's engine
channel, as `pagedllm serve` runs it) and, with --with-vllm, `vllm serve` (its CPU build, OpenAI API), driven by one asyncio client at
concurrency 1, 8, 32 and 64.

    .venv/bin/python perf/serving.py --with-vllm            # 125M Llama, bf16, 2 rounds per engine
    .venv/bin/python perf/serving.py --quick                # tiny model, pagedllm through Triton only (smoke test)
    .venv/bin/python perf/plots.py                          # PNGs in perf/figures from the last run

The client (aiohttp, one event loop) streams Server-Sent Events from each: Triton's
`/v2/models/pagedllm/generate_stream`, and `/v1/completions` with `stream: true` from our OpenAI front end
and from vLLM (the same body for both). Every request asks for
exactly --max-tokens greedy tokens (ignore_eos) after the same text prompt (random tokens of 32-256,
decoded), 64-128 requests per level. Per level: output tokens/s over the level's wall time, TTFT p50/p99, ITL
p50/p99 (genai-perf's definition, per request: (end - first token) / (tokens - 1); percentiles interpolated as
numpy's), requests/s, and the client's own CPU use (it
shares the 2 cores with the server, so it is printed to show it stays small).

Each engine gets its own server with the same model, dtype, max_model_len, max_num_seqs (64) and KV space
(1 GiB), started fresh for each round and warmed up with one untimed wave; vLLM runs with its CPU docs' setup
(tcmalloc and Intel OpenMP preloaded, threads bound). Rounds alternate the engines' order (forward, then
reversed); each figure is the median over rounds, and the ratios are each of ours / vLLM (throughput: higher is
better; latencies: lower is better).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from common import OUT_DIR, emit, model_dir, pct
from pagedllm.net import free_port
from pagedllm.serving import launcher

MAX_MODEL_LEN, MAX_NUM_SEQS, KV_GIB = 1024, 64, 1
ENGINE = {"dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_GIB << 30,
          "max_num_seqs": MAX_NUM_SEQS}


def make_prompts(path: str, n: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(32, 256))]) for _ in range(n)]


class PagedServer:
    name = "pagedllm-triton"

    def __init__(self, path: str, stream_interval: int = 1, engine_channel: bool = False) -> None:
        workdir = Path(tempfile.mkdtemp(prefix="pagedllm-serving-"))
        # The model's engine channel, for a front end to take, as `pagedllm serve` lays it out.
        self.channel = launcher.engine_channel_path(workdir) if engine_channel else None
        self.run = launcher.launch_on_free_ports(workdir, path, {**ENGINE, "openai_channel": self.channel,
                                                                 "stream_interval": stream_interval})
        self.url = f"http://127.0.0.1:{self.run.http_port}/v2/models/pagedllm/generate_stream"

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(
            {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})}

    def stop(self) -> None:
        launcher.stop_server(self.run.proc)


class PagedOpenAIServer(PagedServer):
    """The same Triton server with `pagedllm openai` in front of it (what `pagedllm serve` runs on its
    --openai-port), driven with the body and endpoint vLLM gets: OpenAI clients' path to us."""

    name = "pagedllm-openai"

    def __init__(self, path: str, stream_interval: int = 1, engine_channel: bool = True) -> None:
        # As `pagedllm serve` runs it: over the model's engine channel (False: through Triton's HTTP endpoint).
        super().__init__(path, stream_interval, engine_channel)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        try:
            self.frontend = launcher.start_openai_frontend("127.0.0.1", port, f"127.0.0.1:{self.run.http_port}", 10,
                                                           self.channel)
            launcher.wait_openai_ready(base, self.frontend)
        except Exception:
            super().stop()
            raise
        self.url = f"{base}/v1/completions"

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {"model": "pagedllm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}

    def stop(self) -> None:
        launcher.stop_server(self.frontend, 30)  # SIGTERM (it drains), then its session's group killed
        super().stop()


class VllmServer:
    name = "vllm-serve"

    def __init__(self, path: str, stream_interval: int = 1) -> None:
        from vllm_env import VLLM_VENV, ensure_vllm, peer_env

        ensure_vllm()
        port = free_port()
        self.path = path
        log = os.path.join(tempfile.gettempdir(), "vllm-serve.log")
        with open(log, "w") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                 "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                 "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--seed", "0",
                 *(["--stream-interval", str(stream_interval)] if stream_interval > 1 else [])],
                env=peer_env(KV_GIB), start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
        launcher.wait_for_200(f"http://127.0.0.1:{port}/health", self.proc, 900, "vllm serve", f"; see {log}")
        self.url = f"http://127.0.0.1:{port}/v1/completions"

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {"model": self.path, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


async def one_request(session, server, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, end to end) of one streamed request, in seconds."""
    start = time.perf_counter()
    first = None
    async with session.post(server.url, json=server.body(prompt, max_tokens)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data:") and first is None and line.strip() != b"data: [DONE]":
                first = time.perf_counter()
    return first - start, time.perf_counter() - start


async def run_level(server, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    results = []

    async def bounded(session, prompt):
        async with gate:
            results.append(await one_request(session, server, prompt, max_tokens))

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(bounded(session, p) for p in prompts))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ttft = [t for t, _ in results]
    itl = [(e2e - t) / (max_tokens - 1) for t, e2e in results]
    return {"engine": server.name, "concurrency": concurrency, "requests": len(prompts),
            "output_tokens_per_s": round(len(prompts) * max_tokens / wall, 1),
            "requests_per_s": round(len(prompts) / wall, 3),
            "ttft_p50_ms": round(1000 * pct(ttft, 0.5), 1), "ttft_p99_ms": round(1000 * pct(ttft, 0.99), 1),
            "itl_p50_ms": round(1000 * pct(itl, 0.5), 2), "itl_p99_ms": round(1000 * pct(itl, 0.99), 2),
            "client_cpu_cores": round(cpu / wall, 3), "ttft_s": ttft, "itl_s": itl}


METRICS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "client_cpu_cores")


def sweep(server_class, path: str, levels: list[int], workloads: dict, max_tokens: int, rnd: int,
          stream_interval: int):
    """One server's levels in turn, each yielded as it completes."""
    server = server_class(path, stream_interval)
    try:
        asyncio.run(run_level(server, workloads["warmup"], 8, max_tokens))  # one untimed wave
        for c in levels:
            level = asyncio.run(run_level(server, workloads[c], c, max_tokens))
            emit({"round": rnd, **{k: v for k, v in level.items() if k not in ("ttft_s", "itl_s")}})
            yield level
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--with-vllm", action="store_true")
    ap.add_argument("--front-ends", default=None,
                    help="ours to drive: triton (SSE generate_stream), openai (`pagedllm openai` in front of it); "
                         "default both (triton alone with --quick)")
    ap.add_argument("--size", default=None, help="tiny_model size (default 125m; tiny with --quick)")
    ap.add_argument("--concurrency", default=None, help="default 1,8,32,64 (1,8 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128 (16 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 with --with-vllm, else 1")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="every engine's stream interval (vLLM's --stream-interval; ours the engine argument): "
                         "a stream's events every N tokens, its first at once (default 1: each token)")
    args = ap.parse_args()
    size = args.size or ("tiny" if args.quick else "125m")
    max_tokens = args.max_tokens or (16 if args.quick else 128)
    levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32,64")).split(",")]
    rounds = args.rounds or (2 if args.with_vllm else 1)
    path = model_dir("llama", size, "bfloat16")
    # The same prompts for both engines: per level 4 x concurrency requests, at least 64 (as the independent
    # client used; a p99 of fewer is its slowest request alone) and at most 128, and a warm-up wave.
    sizes = {c: min(128, max(64, 4 * c)) if not args.quick else max(4, 2 * c) for c in levels}
    workloads = {c: make_prompts(path, n, seed=c) for c, n in sizes.items()}
    workloads["warmup"] = make_prompts(path, 8, seed=10_000)
    ours = {"triton": PagedServer, "openai": PagedOpenAIServer}
    front_ends = (args.front_ends or ("triton" if args.quick else "triton,openai")).split(",")
    servers = [ours[f] for f in front_ends] + ([VllmServer] if args.with_vllm else [])
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for server_class in (servers if r % 2 == 0 else servers[::-1]):
            for level in sweep(server_class, path, levels, workloads, max_tokens, r + 1, args.stream_interval):
                runs.setdefault((level["engine"], level["concurrency"]), []).append(level)
                # after every level, so that a run cut short still leaves perf/plots.py what it measured (a quick
                # run leaves the last real run's samples alone)
                if not args.quick:
                    write_samples(summarize(runs, size, max_tokens, args.stream_interval), runs)
    for row in summarize(runs, size, max_tokens, args.stream_interval):
        emit({"median_over_rounds": True, **row})
    if args.with_vllm:
        for engine, c in itertools.product((s.name for s in servers[:-1]), levels):
            mine, theirs = runs[(engine, c)], runs[("vllm-serve", c)]
            emit({"engine": engine, "concurrency": c, **{
                f"ratio_{m}": round(statistics.median(lv[m] for lv in mine) /
                                    statistics.median(lv[m] for lv in theirs), 3)
                for m in METRICS if m != "client_cpu_cores"}})


def summarize(runs: dict[tuple[str, int], list[dict]], size: str, max_tokens: int,
              stream_interval: int) -> list[dict]:
    """Per engine and concurrency, the median of each metric over the rounds run so far."""
    return [{"engine": engine, "model": f"llama-{size}", "max_tokens": max_tokens, "concurrency": c,
             "stream_interval": stream_interval,
             "rounds": len(levels_run), **{m: statistics.median(lv[m] for lv in levels_run) for m in METRICS}}
            for (engine, c), levels_run in runs.items()]


def write_samples(summary: list[dict], runs: dict[tuple[str, int], list[dict]]) -> None:
    """perf/plots.py's input: the summary, and each engine's latest round of per-request latencies."""
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "serving_samples.json"), "w") as f:
        json.dump({"summary": summary, "samples": [{k: lv[k] for k in ("engine", "concurrency", "ttft_s", "itl_s")}
                                                   for lv in (v[-1] for v in runs.values())]}, f)


if __name__ == "__main__":
    main()
