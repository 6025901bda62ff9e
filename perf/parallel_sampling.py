"""What forking saves: `n` samples of each prompt (prefilled once, blocks shared, the last one copied on write)
against the same samples sent as n independent requests with the derived seeds (each prefills its prompt),
in one engine, interleaved over several rounds after a warm-up, with prefix caching on (independent copies
then share the prompt's blocks too, once one has computed them) and off. Both make the same tokens (counted),
so the ratio is wall time; the KV blocks in use at the peak are reported for each.

    .venv/bin/python perf/parallel_sampling.py [--quick] [--size small|125m] [--rounds 3] [--n 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams


def run(llm, requests) -> tuple[float, list, int]:
    """(seconds, outputs, most KV blocks in use at once) of one batch stepped to completion."""
    engine = llm.engine
    t0, peak, outs = time.perf_counter(), 0, {}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request({"prompt_token_ids": prompt}, params, request_id=str(i))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id)] = out
        peak = max(peak, engine.kv.num_usable_blocks - engine.kv.num_free_blocks)
    return time.perf_counter() - t0, [outs[i] for i in range(len(requests))], peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    size, rounds, num = ("tiny", 1, 4) if args.quick else (args.size, args.rounds, args.prompts)
    n = args.n
    for caching in (True, False):
        llm = LLM(model_dir("llama", size, "bfloat16"), dtype="bfloat16", max_model_len=1024,
                  kv_cache_memory_bytes=1 << 30, max_num_seqs=num * n, enable_prefix_caching=caching)
        measure(llm, num, n, rounds, args.max_tokens, size, caching)


def measure(llm, num: int, n: int, rounds: int, max_tokens: int, size: str, caching: bool) -> None:
    prompts = random_workload(num, 256, 512, 2000, seed=2)
    kw = dict(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    forked = [(p, SamplingParams(n=n, seed=1000 * i, **kw)) for i, p in enumerate(prompts)]
    separate = [(p, SamplingParams(seed=1000 * i + j, **kw)) for i, p in enumerate(prompts) for j in range(n)]
    run(llm, forked[:2])  # warm-up: kernels, attention race, allocator
    run(llm, separate[:2])
    ratios, peaks, same, total = [], None, 0, 0
    for _ in range(rounds):
        if caching:
            llm.reset_prefix_cache()  # each round starts cold: no prompt is cached from the one before
        tf, of, pf = run(llm, forked)
        if caching:
            llm.reset_prefix_cache()
        ts, os_, ps = run(llm, separate)
        tokens_f = [c.token_ids for o in of for c in o.outputs]
        tokens_s = [o.outputs[0].token_ids for o in os_]
        ratios.append(ts / tf)
        peaks = (pf, ps)
        same, total = sum(a == b for a, b in zip(tokens_f, tokens_s)), len(tokens_s)
    emit({"model": f"llama-{size}", "prefix_caching": caching, "prompts": num, "n": n, "prompt_tokens": "256-512",
          "max_tokens": max_tokens, "speedup_per_round": [round(r, 3) for r in ratios],
          "speedup_median": round(statistics.median(ratios), 3), "peak_kv_blocks_forked": peaks[0],
          "peak_kv_blocks_separate": peaks[1], "kv_ratio_separate_over_forked": round(peaks[1] / peaks[0], 2),
          "identical_samples": f"{same}/{total}"})


if __name__ == "__main__":
    main()
