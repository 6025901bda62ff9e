"""Offline throughput over a grid of workloads, pagedllm against vLLM's CPU build, side by side in one run.

    .venv/bin/python perf/throughput.py                                 # the whole grid (hours on 2 cores)
    .venv/bin/python perf/throughput.py --sizes 125m --prompts short --outputs 128 --seqs 64   # one cell
    .venv/bin/python perf/throughput.py --engines pagedllm --quick      # smoke test: tiny model, no peer
    .venv/bin/python perf/throughput.py --sizes 125m --prompts short --outputs 128 --seqs 1,8,64 \
        --engines pagedllm,pagedllm:kv_cache_dtype=fp8                  # a variant against the baseline

An engine `pagedllm:KEY=VALUE[:KEY=VALUE]` is pagedllm with those engine arguments: its cells are also shown
as a ratio to plain `pagedllm`, with both footprints (weight bytes, KV bytes per token). `checkpoint=awq` (or
gptq) runs the model quantized to int4 from the same dense weights (common.quantized_model_dir).

The grid: models 19m (Llama, 4 layers), 125m (Llama, 12 layers) and 0.5b (Qwen2 shapes, 24 layers, 2 KV
heads) in bf16; prompts of 32-256 ("short") or 1,000-2,000 ("long") random tokens; 128 or 512 greedy
output tokens each (ignore_eos); 1, 8, 64 or 256 sequences in one `generate` call.

How each engine is treated (the same for both):
- its documented best configuration: vLLM with its CPU docs' setup (tcmalloc and Intel OpenMP preloaded,
  VLLM_CPU_OMP_THREADS_BIND), its own defaults otherwise; pagedllm with its defaults;
- the same prompts, output lengths, dtype, max_model_len, max_num_seqs (256) and KV space (--kv-gib);
- one process per engine and model, kept loaded (offline_worker.py); the engines alternate cell by cell,
  in ABBA order, so the host's drift falls on both;
- per cell: one untimed warm-up run of the cell itself, then timed runs (at least --repeats, and at least
  --min-seconds in all), the prefix cache reset before each; every run is printed, and the cell's figure is
  the median of its timed runs (steady state). With --rounds N the engines instead take turns run by run:
  after each one's warm-up, N rounds of one timed run per engine (ABBA from round to round), so that a
  slow spell of the host (minutes long on these shared machines) falls on every engine, not on whichever
  was running its block of repeats then.

Prints one JSON line per engine and cell (every run), one per cell with the ratio pagedllm / vLLM, and the
geometric mean of the ratios per model and over the grid.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from common import emit, quantized_model_dir, model_dir, random_workload

PROMPTS = {"short": (32, 256), "long": (1000, 2000)}
MODELS = {"19m": ("llama", "small"), "125m": ("llama", "125m"), "0.5b": ("qwen2", "0.5b"),
          "tiny": ("llama", "tiny")}
WORKER = Path(__file__).with_name("offline_worker.py")


class Worker:
    """One engine in its own process, holding one model, timing the cells it is sent."""

    def __init__(self, label: str, model: str, dtype: str, kv_gib: int, quantized=None) -> None:
        self.engine = label
        engine, *pairs = label.split(":")
        options = {k: _value(v) for k, v in (p.split("=", 1) for p in pairs)}
        if "checkpoint" in options:
            model = quantized(options.pop("checkpoint"))
        if engine == "vllm":
            from vllm_env import ensure_vllm, peer_env

            python, env = str(ensure_vllm()), peer_env(kv_gib)
        else:
            python, env = sys.executable, None
        # its own session, so that the worker can take its whole process group down (offline_worker.py)
        self.proc = subprocess.Popen([python, str(WORKER), engine, model, dtype, str(kv_gib), json.dumps(options)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.ready = self._read()  # {"ready": ..., footprint} once the model is loaded

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.engine} worker exited ({self.proc.wait()})")

    def run(self, prompts, max_tokens: int, repeats: int, min_seconds: float, warmup: bool = True) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "repeats": repeats,
                                          "min_seconds": min_seconds, "warmup": warmup}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        try:  # whatever the engine left behind in the worker's group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="19m,125m,0.5b")
    ap.add_argument("--prompts", default="short,long")
    ap.add_argument("--outputs", default="128,512")
    ap.add_argument("--seqs", default="1,8,64,256")
    ap.add_argument("--engines", default="pagedllm,vllm")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell, at least")
    ap.add_argument("--min-seconds", type=float, default=10.0, help="timed seconds per cell, at least")
    ap.add_argument("--rounds", type=int, default=0, help="engines take turns run by run, N timed runs each")
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompts, 16 tokens, 1 and 8 seqs")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.prompts, args.outputs, args.seqs, args.min_seconds = "tiny", "short", "16", "1,8", 0.0
    engines = args.engines.split(",")
    ratios: dict[str, list[float]] = {}
    for size in args.sizes.split(","):
        arch, shape = MODELS[size]
        path = model_dir(arch, shape, args.dtype)
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        workers = [Worker(e, path, args.dtype, args.kv_gib, lambda method: quantized_model_dir(arch, shape, method))
                   for e in engines]
        for w in workers:
            if "weight_bytes" in w.ready:
                emit({"model": size, "engine": w.engine, "weight_mib": round(w.ready["weight_bytes"] / 2**20, 1),
                      "kv_bytes_per_token": w.ready["kv_bytes_per_token"]})
        cells = itertools.product(args.prompts.split(","), map(int, args.outputs.split(",")),
                                  map(int, args.seqs.split(",")))
        for i, (kind, max_tokens, seqs) in enumerate(cells):
            prompts = random_workload(seqs, *PROMPTS[kind], vocab, seed=i)
            cell = {"model": size, "prompts": kind, "output_tokens": max_tokens, "seqs": seqs}
            medians = {}
            for engine, (warmup, rates) in _cell_runs(workers, prompts, max_tokens, i, args).items():
                medians[engine] = statistics.median(rates)
                emit({**cell, "engine": engine, "warmup_s": round(warmup, 4),
                      "runs_tokens_per_s": [round(r, 1) for r in rates],
                      "steady_state_tokens_per_s": round(medians[engine], 1)})
            if "vllm" in medians and "pagedllm" in medians:
                ratio = medians["pagedllm"] / medians["vllm"]
                ratios.setdefault(size, []).append(ratio)
                emit({**cell, "ratio_pagedllm_over_vllm": round(ratio, 3)})
            for variant in (e for e in medians if e.startswith("pagedllm:") and "pagedllm" in medians):
                emit({**cell, "engine": variant, "ratio_over_pagedllm": round(medians[variant] / medians["pagedllm"], 3)})
        for w in workers:
            w.close()
        if size in ratios:
            emit({"model": size, "cells": len(ratios[size]), "geomean_ratio_pagedllm_over_vllm":
                  round(_geomean(ratios[size]), 3), "min_ratio": round(min(ratios[size]), 3)})
    every = [r for rs in ratios.values() for r in rs]
    if every:
        emit({"grid": "all", "cells": len(every), "geomean_ratio_pagedllm_over_vllm": round(_geomean(every), 3),
              "min_ratio": round(min(every), 3), "cells_below_1": sum(r < 1 for r in every)})


def _cell_runs(workers, prompts, max_tokens: int, i: int, args) -> dict[str, tuple[float, list[float]]]:
    """Per engine: its warm-up seconds and its timed runs' tokens/s, engines in ABBA order (neither always
    first): each its block of repeats, or with --rounds one run at a time."""
    def order(k: int):
        return workers if k % 2 == 0 else workers[::-1]

    out = {w.engine: (0.0, []) for w in workers}
    for k, (repeats, min_seconds, warmup) in enumerate(
            [(1, 0.0, True)] + [(1, 0.0, False)] * (args.rounds - 1) if args.rounds
            else [(args.repeats, args.min_seconds, True)]):
        for w in order(i + k):
            res = w.run(prompts, max_tokens, repeats, min_seconds, warmup)
            before, rates = out[w.engine]
            rates = rates + [t / s for t, s in zip(res["tokens"], res["seconds"])]
            out[w.engine] = (before + res["warmup_seconds"], rates)
    return out


def _value(text: str):
    """An engine argument from the command line: JSON where it parses (numbers, booleans), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


if __name__ == "__main__":
    main()
