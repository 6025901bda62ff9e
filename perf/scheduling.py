"""Prefix caching and chunked prefill, each measured on and off in one run.

1. Shared prefix: 64 requests sharing a 1,000-token system prompt with distinct 50-token questions, 64 output
   tokens each: throughput and mean TTFT, prefix caching on vs off.
2. Mixed: a few 2,000-token prompts arriving among short requests that are decoding: p50/p99 inter-token
   latency of the short requests, chunked prefill on vs off.

    .venv/bin/python perf/scheduling.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind


def shared_prefix(path, n, prefix_len, question_len, out_len, caching: bool) -> dict:
    llm = LLM(path, dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=1 << 30,
              enable_prefix_caching=caching, max_num_seqs=n)
    system = random_workload(1, prefix_len, prefix_len, 32000, seed=1)[0]
    questions = random_workload(n, question_len, question_len, 32000, seed=2)
    prompts = [{"prompt_token_ids": system + q} for q in questions]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    if caching:
        llm.reset_prefix_cache()  # the measured run pays for the first prefix itself
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {"workload": "shared_prefix", "prefix_caching": caching, "requests": n,
            "output_tokens_per_s": round(n * out_len / elapsed, 1), "mean_ttft_ms": round(1000 * statistics.mean(ttft), 1),
            "prefix_hit_rate": round(llm.get_stats().prefix_cache_hits / max(1, llm.get_stats().prefix_cache_queries), 3)}


def mixed(path, n_short, n_long, long_len, out_len, chunked: bool) -> dict:
    llm = LLM(path, dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=1 << 30,
              enable_chunked_prefill=chunked, max_num_batched_tokens=256 if chunked else 2048,
              enable_prefix_caching=False)
    engine = llm.engine
    short = random_workload(n_short, 20, 60, 32000, seed=3)
    longs = random_workload(n_long, long_len, long_len, 32000, seed=4)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    short_ids = {engine.add_request({"prompt_token_ids": p}, params) for p in short}
    last, gaps, step = {}, [], 0
    arrivals = {8 + 12 * i: p for i, p in enumerate(longs)}  # long prompts arrive while shorts decode
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if step in arrivals:
            engine.add_request({"prompt_token_ids": arrivals[step]}, SamplingParams(temperature=0, max_tokens=8))
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in short_ids and o.outputs[0].token_ids:
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
        step += 1
    gaps.sort()
    return {"workload": "mixed", "chunked_prefill": chunked, "short_requests": n_short, "long_prompts": n_long,
            "long_prompt_tokens": long_len, "itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 2),
            "itl_p99_ms": round(1000 * gaps[int(0.99 * len(gaps))], 2),
            "itl_max_ms": round(1000 * gaps[-1], 2), "seconds": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    path = model_dir("llama", "tiny" if args.quick else "small", "bfloat16")
    n = 16 if args.quick else 64
    res = {c: shared_prefix(path, n, 1000, 50, 64, c) for c in (False, True)}
    for r in res.values():
        emit(r)
    emit({"workload": "shared_prefix", "throughput_ratio_on_over_off":
          round(res[True]["output_tokens_per_s"] / res[False]["output_tokens_per_s"], 2),
          "ttft_ratio_off_over_on": round(res[False]["mean_ttft_ms"] / res[True]["mean_ttft_ms"], 2)})
    mix = {c: mixed(path, 16, 3 if not args.quick else 1, 2000, 64, c) for c in (False, True)}
    for r in mix.values():
        emit(r)
    emit({"workload": "mixed", "itl_p99_ratio_off_over_on":
          round(mix[False]["itl_p99_ms"] / mix[True]["itl_p99_ms"], 2)})


if __name__ == "__main__":
    main()
