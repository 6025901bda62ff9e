"""Time from start to ready, as a user meets it: `pagedllm serve` (the real tritonserver) until Triton's
model-ready endpoint answers, and an offline `LLM(...)` until it returns, each in a fresh process.

    python perf/startup.py                      # the default model (SmolLM2-135M Q4_1 GGUF), 3 of each
    python perf/startup.py --model DIR --runs 5
    python perf/startup.py --cold-caches         # a fresh machine: empty torch extension directory and GGUF
                                                 # metadata cache

Each run prints its wall time and the engine's own "engine ready in ..." line (its phases). With
--cold-caches the C++ kernels are first built as scripts/install.sh builds them (timed on their own), and
only the first serve run is cold; the rest find the caches it filled.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedllm.serving import launcher

_OFFLINE = ("import logging, sys, time; t = time.monotonic(); logging.basicConfig(level=logging.INFO); "
            "from pagedllm import LLM; LLM(sys.argv[1]); print(f'offline ready {time.monotonic() - t:.1f}')")


def _engine_line(text: str) -> str:
    m = re.search(r"engine ready in ([0-9.]+ s \([^)]*\))", text)
    return m.group(1) if m else "(no engine ready line)"


def time_serve(model: str) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as work:
        start = time.monotonic()
        run = launcher.launch_on_free_ports(Path(work), model, {})
        ready = time.monotonic() - start
        launcher.stop_server(run.proc)
        return ready, _engine_line(run.log.read_text())


def time_offline(model: str) -> tuple[float, str]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _OFFLINE, model], capture_output=True, text=True, check=True)
    return time.monotonic() - start, _engine_line(done.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model of `pagedllm serve`")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold-caches", action="store_true")
    args = ap.parse_args()
    model = args.model or str(launcher.default_model())
    if args.cold_caches:
        os.environ["PAGEDLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedllm-cold-")
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="torch-ext-cold-")
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "pagedllm_kernels.cpu.build"], check=True)
        print(f"install  C++ kernels built in {time.monotonic() - start:.1f} s", flush=True)
    print(f"model {model}")
    for name, timed in (("serve", time_serve), ("offline", time_offline)):
        for i in range(args.runs):
            seconds, engine = timed(model)
            print(f"{name:8s} run {i + 1}: ready after {seconds:6.1f} s; engine ready in {engine}", flush=True)


if __name__ == "__main__":
    main()
