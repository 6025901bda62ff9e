"""A lone prompt's prefill: the served TTFT of a request that arrives alone, less Triton's ~3 ms (perf/README.md,
session 24). For each length, one prompt of that many tokens (or --prompts of them in one call), one output
token, each engine kept loaded in its own process (throughput.py's workers: vLLM with its CPU documentation's
setup), the engines taking turns round by round (ABBA), --repeats calls a round after a warm-up; the median ms
per call and each engine's ratio to the last one named (the baseline). Engines as throughput.py takes them:
`pagedllm`, `vllm`, or a variant `pagedllm:ARG=VALUE` (say `cpu_decoder_loop=false`).

    python perf/prefill.py [--size 125m] [--lengths 64,128,256,512] [--prompts 1] [--engines pagedllm,vllm]
                           [--rounds 4] [--repeats 10] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import emit, model_dir, random_workload
from throughput import MODELS, Worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="125m", choices=sorted(MODELS))
    ap.add_argument("--lengths", default="64,128,256,512")
    ap.add_argument("--prompts", type=int, default=1, help="prompts of each length in one call")
    ap.add_argument("--engines", default="pagedllm,vllm")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per engine a round")
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 and 64 tokens, 2 rounds of 2 calls")
    args = ap.parse_args()
    if args.quick:
        args.size, args.lengths, args.rounds, args.repeats = "tiny", "16,64", 2, 2
    arch, shape = MODELS[args.size]
    path = model_dir(arch, shape, args.dtype)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    workers = [Worker(e, path, args.dtype, 2) for e in args.engines.split(",")]
    for i, length in enumerate(int(n) for n in args.lengths.split(",")):
        prompts = random_workload(args.prompts, length, length, vocab, seed=i)
        seconds = {w.engine: [] for w in workers}
        for r in range(args.rounds):
            for w in (workers if (i + r) % 2 == 0 else workers[::-1]):
                seconds[w.engine] += w.run(prompts, 1, args.repeats, 0.0, warmup=r == 0)["seconds"]
        ms = {e: statistics.median(s) * 1e3 for e, s in seconds.items()}
        baseline = workers[-1].engine
        for engine, value in ms.items():
            emit({"model": args.size, "prompt_tokens": length, "prompts": args.prompts, "engine": engine,
                  "median_ms": round(value, 2), "baseline": baseline,
                  "ratio_to_baseline": round(value / ms[baseline], 3)})
    for w in workers:
        w.close()


if __name__ == "__main__":
    main()
