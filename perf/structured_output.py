"""Structured output's cost: output tokens/s of a batch where half the requests follow a JSON schema, against
the same batch with no constraint, in one engine, interleaved over several rounds after a warm-up (steady
state); grammar compile time reported separately (a cache miss: a schema not seen before).

Every request runs to max_tokens in both batches, so both make the same number of tokens: the constrained
half follows a schema whose shortest valid output is longer than max_tokens (an array of at least 500
integers), and the free half ignores EOS.

    .venv/bin/python perf/structured_output.py [--quick] [--size small|125m] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams

LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}, "minItems": 500}


def timed(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", default="small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    size, rounds, n = ("tiny", 2, 16) if args.quick else (args.size, args.rounds, args.num_seqs)
    llm = LLM(model_dir("llama", size, "bfloat16"), dtype="bfloat16", max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, max_num_seqs=n)
    prompts = random_workload(n, 32, 256, 2000, seed=1)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": LONG_SCHEMA})
    mixed = [constrained if i % 2 else free for i in range(n)]

    compiler = llm.engine.input_processor
    compile_ms = []
    for i in range(5):  # fresh schemas: cache misses
        schema = dict(LONG_SCHEMA, description=f"run {time.time()} {i}")
        t0 = time.perf_counter()
        compiler.compile_grammar(SamplingParams(structured_outputs={"json": schema}))
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    compiler.compile_grammar(SamplingParams(structured_outputs={"json": LONG_SCHEMA}))
    t1 = time.perf_counter()
    compiler.compile_grammar(SamplingParams(structured_outputs={"json": json.dumps(LONG_SCHEMA)}))
    cached_ms = (time.perf_counter() - t1) * 1e3

    timed(llm, prompts[:4], [free, constrained] * 2)  # warm-up: kernels, attention race, allocator
    ratios, free_tps, mixed_tps = [], [], []
    for _ in range(rounds):
        tf, nf = timed(llm, prompts, [free] * n)
        tm, nm = timed(llm, prompts, mixed)
        assert nf == nm == n * args.max_tokens, (nf, nm)
        free_tps.append(nf / tf)
        mixed_tps.append(nm / tm)
        ratios.append((nm / tm) / (nf / tf))
    emit({"model": f"llama-{size}", "num_seqs": n, "constrained": n // 2, "max_tokens": args.max_tokens,
          "free_tokens_per_s": [round(x, 1) for x in free_tps],
          "half_constrained_tokens_per_s": [round(x, 1) for x in mixed_tps],
          "ratio_per_round": [round(r, 3) for r in ratios], "ratio_median": round(statistics.median(ratios), 3),
          "target": 0.85, "compile_ms_cache_miss": [round(x, 2) for x in compile_ms],
          "compile_ms_first_of_this_schema": round((t1 - t0) * 1e3, 2), "compile_ms_cache_hit": round(cached_ms, 3)})


if __name__ == "__main__":
    main()
