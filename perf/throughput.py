"""Offline throughput: pagedllm vs transformers `generate` (static batches, left padding), same model and
workload, in one run. Prints one JSON line per result and the ratio.

    .venv/bin/python perf/throughput.py            # 125M Llama and the small one, bf16
    .venv/bin/python perf/throughput.py --quick    # small model, fewer prompts (smoke test)
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common import emit, matmul_peak_flops, model_dir, model_flops_per_token, random_workload
from pagedllm import LLM, SamplingParams


def run_pagedllm(path, prompts, max_tokens, dtype):
    llm = LLM(path, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=2 << 30, max_num_seqs=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def run_transformers(path, prompts, max_tokens, dtype, batch_size):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = 2
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(batch)
    return generated, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma list of tiny_model sizes (default: 125m,small)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    sizes = (args.sizes or ("small" if args.quick else "125m,small")).split(",")
    n, max_tokens = (16, 32) if args.quick else (64, 128)
    torch.manual_seed(0)
    peak = matmul_peak_flops(getattr(torch, args.dtype))
    emit({"metric": "matmul_peak_gflops", "dtype": args.dtype, "value": round(peak / 1e9, 1)})
    for size in sizes:
        path = model_dir("llama", size, args.dtype)
        cfg = AutoConfig.from_pretrained(path)
        prompts = random_workload(n, 32, 256, cfg.vocab_size)
        prompt_tokens = sum(len(p) for p in prompts)
        flops_tok = model_flops_per_token(cfg)
        results = {}
        for name, fn in (("pagedllm", lambda: run_pagedllm(path, prompts, max_tokens, args.dtype)),
                         ("transformers", lambda: run_transformers(path, prompts, max_tokens, args.dtype, 16))):
            tokens, elapsed = fn()
            tps = tokens / elapsed
            achieved = flops_tok * (tokens + prompt_tokens) / elapsed
            results[name] = tps
            emit({"engine": name, "model": f"llama-{size}", "dtype": args.dtype, "prompts": n,
                  "output_tokens": tokens, "seconds": round(elapsed, 2), "output_tokens_per_s": round(tps, 1),
                  "achieved_gflops": round(achieved / 1e9, 1), "fraction_of_matmul_peak": round(achieved / peak, 3)})
        emit({"model": f"llama-{size}", "ratio_pagedllm_over_transformers":
              round(results["pagedllm"] / results["transformers"], 2)})


if __name__ == "__main__":
    main()
