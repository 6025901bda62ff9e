"""Decode attention on CPU as a serving step sees it: one query token per row over its paged context, 12 layers'
caches in turn (so each call streams its K/V from memory, not from the last level cache), the 125M model's
shapes (12 heads, 4 KV heads of 64, bf16, block size 16, blocks scattered). Per (rows x longest context): ms per
layer call and GB/s of K/V read, against this host's streaming read bandwidth measured in the same run.

    .venv/bin/python perf/decode_attention.py [--shapes 64x400,32x600,8x1024,4x2048] [--passes 7]
    .venv/bin/python perf/decode_attention.py --against OLD/paged_attention.cpp   # A/B: that source, alternated
    .venv/bin/python perf/decode_attention.py --kv-cache-dtype fp8   # an e4m3 cache (bytes counted as 1 each)

--against builds another version of kernels/pagedllm_kernels/cpu/paged_attention.cpp (say, `git show
REV:kernels/pagedllm_kernels/cpu/paged_attention.cpp > /tmp/old.cpp`) as an extension of its own and alternates
the two call by call on the same caches, ABBA; the ratio is old time / our time. Calibrate it with an A/A run (our
own source as the other): on Zen 4 that reads 0.93-0.96, the separate build running faster (perf/README.md,
session 36).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import build_kernel_source, emit

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 12, 4, 64, 16


def read_bandwidth(gib: float = 0.5) -> float:
    """Bytes/s of a streaming read (a max over a large int32 tensor), the best of 5."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.int32)
    torch.max(x)
    best = min(_timed(lambda: torch.max(x)) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def caches_for(rows: int, ctx: int, seed: int = 0, cache_dtype: torch.dtype = torch.bfloat16):
    """Per layer a K and a V cache in the kernels' layout (random values, of cache_dtype), one block table for
    all layers (blocks scattered), each row's context length drawn from [ctx / 2, ctx], and the rows' queries."""
    g = torch.Generator().manual_seed(seed)
    per_row = -(-ctx // BLOCK)
    blocks = rows * per_row + 1  # block 0 is the engine's null block
    caches = [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(cache_dtype)
              for _ in range(2 * LAYERS)]
    tables = (torch.randperm(blocks - 1, generator=g) + 1).reshape(rows, per_row)
    lens = torch.randint(ctx // 2, ctx + 1, (rows,), generator=g)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    return q, caches, tables, lens, torch.arange(rows + 1)


def one_pass(fn, q, caches, tables, lens, starts) -> float:
    """Seconds per layer call, over the 12 layers' caches in turn."""
    t0 = time.perf_counter()
    for layer in range(LAYERS):
        fn(q, caches[2 * layer], caches[2 * layer + 1], tables, lens, starts, HEAD_DIM ** -0.5, 0, 1.0, 1.0)
    return (time.perf_counter() - t0) / LAYERS


def decode_call(kernel):
    """A build's paged_attention with the arguments every version takes: since session 28 it also takes `amx`
    (prompts on AMX tiles; since session 29 also decodes of 5+ query heads per KV head, not this script's 125M
    shape), which is passed as off; older sources have no such argument (pybind names it arg10 in the
    signature)."""
    if "arg10" in (kernel.__doc__ or ""):
        return lambda *args: kernel(*args, False)
    return kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x400,32x600,8x1024,4x2048", help="rows x longest context, comma-separated")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--against", default=None, help="another paged_attention.cpp to alternate with ours")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16")
    args = ap.parse_args()
    from pagedllm_kernels.cpu.build import cpu_supported, extension

    ok, why = cpu_supported()
    if not ok:
        raise SystemExit(f"the AVX-512 kernels cannot run here: {why}")
    kernels = {"ours": decode_call(extension().paged_attention)}
    if args.against:
        kernels["other"] = decode_call(build_kernel_source(args.against, "paged_attention"))
    peak = read_bandwidth()
    emit({"bench": "read_bandwidth", "gb_per_s": round(peak / 1e9, 1)})
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    for shape in args.shapes.split(","):
        rows, ctx = (int(v) for v in shape.split("x"))
        q, caches, tables, lens, starts = caches_for(rows, ctx, cache_dtype=cache_dtype)
        outs = {name: fn(q, caches[0], caches[1], tables, lens, starts, HEAD_DIM ** -0.5, 0, 1.0, 1.0)
                for name, fn in kernels.items()}
        if "other" in outs:  # the same arithmetic in the same order: equal outputs
            torch.testing.assert_close(outs["other"].float(), outs["ours"].float(), atol=1e-2, rtol=1e-2)
        times = {name: [] for name in kernels}
        for i in range(args.passes):  # ABBA: neither build always runs first
            for name, fn in (list(kernels.items()) if i % 2 == 0 else list(kernels.items())[::-1]):
                times[name].append(one_pass(fn, q, caches, tables, lens, starts))
        kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * caches[0].element_size()
        row = {"rows": rows, "max_context": ctx, "kv_cache_dtype": args.kv_cache_dtype}
        for name, ts in times.items():
            t = statistics.median(ts)
            row[f"{name}_ms"] = round(1000 * t, 3)
            row[f"{name}_gb_per_s"] = round(kv_bytes / t / 1e9, 1)
        row["ours_share_of_read_bandwidth"] = round(kv_bytes / statistics.median(times["ours"]) / peak, 3)
        if "other" in times:
            row["speed_ratio_ours_over_other"] = round(statistics.median(times["other"]) /
                                                       statistics.median(times["ours"]), 3)
        emit(row)


if __name__ == "__main__":
    main()
