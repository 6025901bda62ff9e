"""Prompt attention on CPU as a prefill step sees it: the CPU paged-attention kernel on whole prompts (causal, each
token over its prefix), blocks scattered, head_dim 64, block size 16, on AMX tiles where the CPU has them. Per
(query heads / KV heads x prompt tokens): ms per layer call and TFLOP/s (the causal half of Q K^T and P V).

    .venv/bin/python perf/prompt_attention.py [--shapes 12/4x512,12/4x1024,12/4x2048,14/2x1024] [--passes 5]
    .venv/bin/python perf/prompt_attention.py --against /tmp/old-cpu   # A/B: another version, alternated
    .venv/bin/python perf/prompt_attention.py --prompts 4 --cold   # 4 prompts a call, caches flushed before each

--against takes a paged_attention.cpp, or a directory holding one with the headers it includes: another
version of kernels/pagedllm_kernels/cpu (`mkdir /tmp/old-cpu && git archive REV kernels/pagedllm_kernels/cpu |
tar -x --strip-components 3 -C /tmp/old-cpu`), built as an extension of its own against its own headers. The two
alternate call by call (ABBA) on the same inputs; the ratio is its time / ours, and max_abs_diff their outputs'
largest difference. --cold writes a 256 MiB buffer before every call (not timed), so K and V come from memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import build_kernel_source, emit

HEAD_DIM, BLOCK = 64, 16


def prompt_inputs(heads: int, kv_heads: int, tokens: int, prompts: int, seed: int = 0):
    """A batch of `prompts` whole prompts of `tokens` tokens: queries, K/V caches with the blocks scattered, and
    the kernel's row arguments."""
    g = torch.Generator().manual_seed(seed)
    per_row = -(-tokens // BLOCK)
    blocks = prompts * per_row + 1  # block 0 is the engine's null block
    k, v = (torch.randn(blocks, BLOCK, kv_heads, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2))
    tables = (torch.randperm(blocks - 1, generator=g) + 1).reshape(prompts, per_row)
    q = (3 * torch.randn(prompts * tokens, heads, HEAD_DIM, generator=g)).to(torch.bfloat16)
    lens = torch.full((prompts,), tokens)
    return q, k, v, tables, lens, torch.arange(prompts + 1) * tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="12/4x512,12/4x1024,12/4x2048,14/2x1024",
                    help="query heads/KV heads x prompt tokens, comma-separated")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per call")
    ap.add_argument("--passes", type=int, default=5, help="timed passes per kernel (each ~0.3 s of calls)")
    ap.add_argument("--cold", action="store_true", help="flush the caches before every call")
    ap.add_argument("--against", default=None, help="another paged_attention.cpp, or a directory holding one")
    args = ap.parse_args()
    from pagedllm_kernels.cpu.build import amx_supported, cpu_supported, extension

    ok, why = cpu_supported()
    if not ok:
        raise SystemExit(f"the AVX-512 kernels cannot run here: {why}")
    amx = amx_supported()[0]
    kernels = {"ours": extension().paged_attention}
    if args.against:
        source = args.against
        if os.path.isdir(source):
            source = os.path.join(source, "paged_attention.cpp")
        kernels["other"] = build_kernel_source(source, "paged_attention")
    flush = torch.ones(64 << 20, dtype=torch.int32) if args.cold else None
    for shape in args.shapes.split(","):
        heads_pair, tokens = shape.split("x")
        heads, kv_heads = (int(v) for v in heads_pair.split("/"))
        tokens = int(tokens)
        inputs = prompt_inputs(heads, kv_heads, tokens, args.prompts)
        call_args = (*inputs, HEAD_DIM ** -0.5, 0, 1.0, 1.0, amx)
        outs = {name: fn(*call_args).float() for name, fn in kernels.items()}
        start = time.perf_counter()
        kernels["ours"](*call_args)
        calls = 1 if args.cold else max(1, int(0.3 / (time.perf_counter() - start)))
        times = {name: [] for name in kernels}
        for i in range(args.passes):  # ABBA: neither build always runs first
            for name, fn in (list(kernels.items()) if i % 2 == 0 else list(kernels.items())[::-1]):
                total = 0.0
                for _ in range(calls):
                    if flush is not None:
                        flush.add_(1)
                    t0 = time.perf_counter()
                    fn(*call_args)
                    total += time.perf_counter() - t0
                times[name].append(total / calls)
        flops = args.prompts * heads * tokens * (tokens + 1) / 2 * HEAD_DIM * 4
        row = {"heads": heads, "kv_heads": kv_heads, "tokens": tokens, "prompts": args.prompts, "amx": amx,
               "cold": args.cold}
        for name, ts in times.items():
            t = statistics.median(ts)
            row[f"{name}_ms"] = round(1000 * t, 3)
            row[f"{name}_tflop_per_s"] = round(flops / t / 1e12, 3)
        if "other" in times:
            row["speed_ratio_ours_over_other"] = round(statistics.median(times["other"]) /
                                                       statistics.median(times["ours"]), 3)
            row["max_abs_diff"] = round((outs["other"] - outs["ours"]).abs().max().item(), 5)
        emit(row)


if __name__ == "__main__":
    main()
