"""What the OpenAI front end (`pagedllm openai`) costs per streamed token, apart from the engine: CPU time and
context switches of its process per token, with a stand-in for the model that streams tokens at a steady rate,
over the model's engine channel (as `pagedllm serve` runs it) or through Triton's HTTP endpoint.

    .venv/bin/python perf/frontend_overhead.py                    # 64 streams, 20 tokens/s each, 3 rounds
    .venv/bin/python perf/frontend_overhead.py --way http         # the front end through Triton's HTTP endpoint
    .venv/bin/python perf/frontend_overhead.py --streams 8 --rate 60
    .venv/bin/python perf/frontend_overhead.py --quick            # 8 streams, 1 round of 2 s (smoke test)

Served, the front end shares the host's cores with the engine, and each of its wake-ups beside two OpenMP threads
costs the engine about twice its own time (perf/README, session 37): its CPU per token is what to make small, and
a served benchmark, whose engine varies by ±5% from one server to the next, cannot see a change of a few percent
of it. Here nothing else varies: the stand-in (its own process) sends the events our model sends for a stream
(`text_output`, `finish_reason`, `num_input_tokens`, `num_output_tokens`, one token each) every 1/rate seconds:
over the channel, every open stream's token in one line per tick (the model writes one per batch of outputs),
through HTTP as Triton's `generate_stream` (aiohttp), one event per stream on that stream's own timer; a client
(one asyncio loop, another process: this one) keeps --streams `/v1/completions` streams open through the front
end, each --tokens long, for --seconds per round. Per round:
the front end's CPU (user + system) and context switches per token, tokens/s, and its resident memory (it
should not grow from round to round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import tempfile
import threading
from pathlib import Path

import aiohttp
import numpy as np
import psutil
from aiohttp import web

from common import emit
from pagedllm.net import free_port
from pagedllm.serving import launcher
from pagedllm.serving.engine_channel import ChannelServer


class TickingModel:
    """The model's side of the engine channel, reduced to a clock: each tick, one token to every open stream,
    then one flush (one line), as the model's response thread writes each batch of a step's outputs."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.left: dict = {}  # stream -> tokens still to send
        self.lock = threading.Lock()

    def on_request(self, stream, arrays: dict, parameters: dict) -> None:
        with self.lock:
            self.left[stream] = json.loads(arrays["sampling_parameters"][0])["max_tokens"]

    def on_cancel(self, stream) -> None:
        with self.lock:
            self.left.pop(stream, None)

    def run(self, server: ChannelServer) -> None:
        while True:
            time.sleep(1 / self.rate)
            with self.lock:
                ticking = list(self.left.items())
                for stream, left in ticking:
                    if left == 1:
                        del self.left[stream]
                    else:
                        self.left[stream] = left - 1
            for stream, left in ticking:
                stream.send_outputs({"text_output": np.array([b" tok"], dtype=np.object_),
                                     "finish_reason": np.array([b"length" if left == 1 else b""], dtype=np.object_),
                                     "num_input_tokens": np.array([100], dtype=np.uint32),
                                     "num_output_tokens": np.array([1], dtype=np.uint32)}, final=left == 1)
            server.flush()


def stand_in(port: int, rate: float, channel: str | None) -> None:
    """Triton's ready and generate_stream endpoints, as our model answers a stream (one event per token every
    1/rate seconds); with `channel`, the model's engine channel at that path too."""
    if channel:
        model = TickingModel(rate)
        threading.Thread(target=model.run, args=(ChannelServer(channel, model.on_request, model.on_cancel),),
                         daemon=True).start()

    async def generate_stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = json.loads(body["sampling_parameters"])["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(1 / rate)
            event = {"model_name": "pagedllm", "model_version": "1", "text_output": " tok",
                     "finish_reason": "length" if i == n - 1 else "", "num_input_tokens": 100,
                     "num_output_tokens": 1}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    async def ready(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v2/models/pagedllm/generate_stream", generate_stream)
    app.router.add_get("/v2/models/pagedllm/ready", ready)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def usage(proc: psutil.Process) -> tuple[float, int, float]:
    """(CPU seconds, user and system; context switches, voluntary and not; resident MiB) of a process so far."""
    cpu, switches = proc.cpu_times(), proc.num_ctx_switches()
    return cpu.user + cpu.system, switches.voluntary + switches.involuntary, proc.memory_info().rss / 2**20


async def drive(url: str, streams: int, tokens: int, seconds: float) -> int:
    """Keep `streams` streams open for `seconds`; the tokens received."""
    body = {"model": "pagedllm", "prompt": "x", "max_tokens": tokens, "stream": True}
    received = 0
    stop = time.monotonic() + seconds

    async def stream_loop(session):
        nonlocal received
        while time.monotonic() < stop:
            async with session.post(url, json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        received += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as session:
        await asyncio.gather(*(stream_loop(session) for _ in range(streams)))
    return received


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rate", type=float, default=20.0, help="tokens per second per stream")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--seconds", type=float, default=15.0, help="per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--way", choices=["channel", "http"], default="channel",
                    help="the front end over the model's engine channel (as `pagedllm serve` runs it) or through "
                         "Triton's HTTP generate_stream")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stand-in", type=int, default=None, help=argparse.SUPPRESS)  # run as the stand-in
    ap.add_argument("--channel", default=None, help=argparse.SUPPRESS)  # the stand-in's channel path
    args = ap.parse_args()
    if args.stand_in is not None:
        return stand_in(args.stand_in, args.rate, args.channel)
    if args.quick:
        args.streams, args.tokens, args.seconds, args.rounds = 8, 16, 2.0, 1
    triton_port, port = free_port(), free_port()
    channel = launcher.engine_channel_path(Path(tempfile.mkdtemp(prefix="pagedllm-overhead-"))) \
        if args.way == "channel" else None
    fake = subprocess.Popen([sys.executable, __file__, "--stand-in", str(triton_port), "--rate", str(args.rate)]
                            + (["--channel", channel] if channel else []), start_new_session=True)
    frontend = None
    try:
        launcher.wait_for_200(f"http://127.0.0.1:{triton_port}/v2/models/pagedllm/ready", fake, 60, "the stand-in", "")
        frontend = launcher.start_openai_frontend("127.0.0.1", port, f"127.0.0.1:{triton_port}", 10, channel)
        launcher.wait_openai_ready(f"http://127.0.0.1:{port}", frontend)
        url = f"http://127.0.0.1:{port}/v1/completions"
        proc = psutil.Process(frontend.pid)
        asyncio.run(drive(url, args.streams, args.tokens, 1 if args.quick else 3))  # warm-up
        rows = []
        for r in range(args.rounds):
            cpu0, sw0, _ = usage(proc)
            t0 = time.perf_counter()
            got = asyncio.run(drive(url, args.streams, args.tokens, args.seconds))
            wall = time.perf_counter() - t0
            cpu1, sw1, rss = usage(proc)
            row = {"round": r + 1, "way": args.way, "streams": args.streams, "tokens_per_s": round(got / wall, 1),
                   "frontend_cores": round((cpu1 - cpu0) / wall, 4),
                   "frontend_us_per_token": round(1e6 * (cpu1 - cpu0) / got, 1),
                   "frontend_switches_per_token": round((sw1 - sw0) / got, 2),
                   "frontend_rss_mib": round(rss, 1)}
            emit(row)
            rows.append(row)
        emit({"median": True, "way": args.way, "streams": args.streams, **{k: statistics.median(r[k] for r in rows) for k in (
            "tokens_per_s", "frontend_cores", "frontend_us_per_token", "frontend_switches_per_token")}})
    finally:
        if frontend is not None:
            launcher.stop_server(frontend, 30)
        launcher.stop_server(fake, 10)


if __name__ == "__main__":
    main()
