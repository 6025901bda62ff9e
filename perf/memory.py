"""KV memory: how many sequences run concurrently in one fixed KV budget with paged blocks, against a
contiguous allocator that reserves max_model_len tokens per sequence (HF-style static KV), on the same
workload; for each KV cache dtype (bf16 and fp8 by default), side by side, and fp8's ratio to bf16. Also the
fraction of reserved KV actually holding tokens.

    .venv/bin/python perf/memory.py [--quick] [--kv-cache-dtypes auto,fp8]
"""

from __future__ import annotations

import argparse

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams
from pagedllm.engine.kv_sizing import KVGeometry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-mib", type=int, default=None,
                    help="KV budget (default 64, or 2 with --quick): small enough that KV bounds the batch")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8", help="comma-separated; auto = the model's bf16")
    args = ap.parse_args()
    if args.budget_mib is None:
        args.budget_mib = 2 if args.quick else 64
    results = {kv: measure(args, kv) for kv in args.kv_cache_dtypes.split(",")}
    for row in results.values():
        emit(row)
    if "auto" in results and "fp8" in results:
        a, b = results["auto"], results["fp8"]
        emit({"fp8_vs_bf16": {
            "kv_bytes_per_token_ratio": round(b["kv_bytes_per_token"] / a["kv_bytes_per_token"], 3),
            "peak_concurrent_sequences_ratio": round(b["paged_peak_concurrent_sequences"]
                                                     / a["paged_peak_concurrent_sequences"], 2),
            "kv_blocks_ratio": round(b["kv_blocks"] / a["kv_blocks"], 3)}})


def measure(args, kv_cache_dtype: str) -> dict:
    size = "tiny" if args.quick else "small"
    path = model_dir("llama", size, "bfloat16")
    budget = args.budget_mib << 20
    llm = LLM(path, dtype="bfloat16", max_model_len=args.max_model_len, kv_cache_memory_bytes=budget,
              max_num_seqs=1024, max_num_batched_tokens=4096, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    block = engine.config.cache.block_size
    per_token = KVGeometry.of(engine.executor.model).bytes_per_block(block, engine.model_info.kv_dtype) // block
    n = 64 if args.quick else 512  # enough demand to fill an fp8 budget too
    prompts = random_workload(n, 32, 256, engine.model_info.vocab_size, seed=5)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    peak_running, peak_used_tokens, utilisation = 0, 0, []
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        held = sum(len(engine.kv.block_ids(r.request_id)) for r in running) * block
        tokens = sum(r.num_computed_tokens for r in running)
        if len(running) > peak_running:
            peak_running, peak_used_tokens = len(running), tokens
        if held:
            utilisation.append(tokens / held)
    contiguous = budget // (per_token * args.max_model_len)
    return {"model": f"llama-{size}", "kv_cache_dtype": kv_cache_dtype, "kv_budget_mib": args.budget_mib,
            "kv_bytes_per_token": per_token, "kv_blocks": engine.kv.pool.num_blocks - 1,
            "max_model_len": args.max_model_len, "requests": n,
            "paged_peak_concurrent_sequences": peak_running, "contiguous_max_len_sequences": contiguous,
            "concurrency_ratio": round(peak_running / max(contiguous, 1), 2),
            "paged_mean_fill_of_held_blocks": round(sum(utilisation) / len(utilisation), 3),
            "contiguous_fill_at_same_load": round(peak_used_tokens / max(1, peak_running * args.max_model_len), 3),
            "preemptions": engine.get_stats().num_preemptions}


if __name__ == "__main__":
    main()
