"""What the transformers fallback costs: output tokens/s of the same Llama checkpoint through the native class
and through transformers' class with paged attention (`model_impl="transformers"`), in one process, each warmed
up by a full pass, then alternated for several rounds (32 random prompts of 32-256 tokens, 64 greedy tokens,
bf16).

    .venv/bin/python perf/fallback.py [--quick] [--sizes small,125m] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams


def timed(llm, prompts, params) -> float:
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="small,125m")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sizes, n, max_tokens, rounds = (["tiny"], 8, 16, 1) if args.quick else (args.sizes.split(","), 32, 64,
                                                                            args.rounds)
    for size in sizes:
        path = model_dir("llama", size, "bfloat16")
        prompts = random_workload(n, 32, 256, 2000, seed=0)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engines = {impl: LLM(path, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=1 << 30,
                             model_impl=impl) for impl in ("pagedllm", "transformers")}
        for llm in engines.values():
            timed(llm, prompts, params)
        rates = {impl: [] for impl in engines}
        for _ in range(rounds):
            for impl, llm in engines.items():
                rates[impl].append(timed(llm, prompts, params))
        native, fallback = statistics.median(rates["pagedllm"]), statistics.median(rates["transformers"])
        emit({"model": f"llama-{size}", "native_tok_s": [round(r, 1) for r in rates["pagedllm"]],
              "fallback_tok_s": [round(r, 1) for r in rates["transformers"]],
              "ratio_fallback_over_native": round(fallback / native, 2)})


if __name__ == "__main__":
    main()
