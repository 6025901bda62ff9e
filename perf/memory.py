"""KV memory: how many sequences run concurrently in one fixed KV budget with paged blocks, against a
contiguous allocator that reserves max_model_len tokens per sequence (HF-style static KV), on the same
workload. Also the fraction of reserved KV actually holding tokens.

    .venv/bin/python perf/memory.py [--quick]
"""

from __future__ import annotations

import argparse

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams
from pagedllm.engine.kv_sizing import KVGeometry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    size = "tiny" if args.quick else "small"
    path = model_dir("llama", size, "bfloat16")
    budget = args.budget_mib << 20
    llm = LLM(path, dtype="bfloat16", max_model_len=args.max_model_len, kv_cache_memory_bytes=budget,
              max_num_seqs=1024, max_num_batched_tokens=4096)
    engine = llm.engine
    block = engine.config.cache.block_size
    per_token = KVGeometry.of(engine.executor.model).bytes_per_block(block, engine.model_info.dtype) // block
    n = 64 if args.quick else 256
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
    emit({"model": f"llama-{size}", "kv_budget_mib": args.budget_mib, "kv_bytes_per_token": per_token,
          "max_model_len": args.max_model_len, "requests": n,
          "paged_peak_concurrent_sequences": peak_running, "contiguous_max_len_sequences": contiguous,
          "concurrency_ratio": round(peak_running / max(contiguous, 1), 2),
          "paged_mean_fill_of_held_blocks": round(sum(utilisation) / len(utilisation), 3),
          "contiguous_fill_at_same_load": round(peak_used_tokens / max(1, peak_running * args.max_model_len), 3),
          "preemptions": engine.get_stats().num_preemptions})


if __name__ == "__main__":
    main()
