"""The AVX2 kernels (CPUs without AVX-512) against the torch paths they replace, alternated pass by pass in one
process; per point the median pass of each and their ratio.

- linears: the 125M model's 49 linears as a forward pass streams them (each its own weight), our AVX2 kernel
  (avx2_linear.py) vs torch's bf16 F.linear, per row count;
- quantized linears: the same 49 linears as int4 (group 128) and as fp8 weights, our AVX2 kernels
  (avx2_quantized.py) against our bf16 kernel, and each format's large-batch path (its weight written as bf16
  tiles per call, then the bf16 kernel); with --torch-paths also the torch dequantization each replaced;
- decode attention: one layer's step of decode rows over their paged contexts (125M's 12 heads of 64), the
  `avx2` backend vs the `torch` backend (its gather + SDPA), store included, per (rows, context).

    .venv/bin/python perf/avx2_kernels.py [--rows 1,2,4,8,16,32,64,256] [--contexts 8x128,8x384,32x384,8x1024]
        [--quantized-rows 1,8,32,64,128,256] [--kv-dtypes bf16,fp8] [--torch-paths]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bf16_linear import SHAPES
from common import emit
from pagedllm.attention.avx2_backend import Avx2Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttention
from pagedllm_kernels import fp8_layout, int4_layout
from pagedllm_kernels.cpu import avx2_linear, avx2_quantized

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16  # the 125M shape (tiny_model.py)


def alternated(fns: dict, passes: int) -> dict:
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(passes):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def linears(rows_list: list[int], passes: int) -> None:
    dense = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]
    tiles = [avx2_linear.pack(w) for w in dense]
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
        t = alternated({
            "ours": lambda: [avx2_linear.linear(xs[k], w) for (_, k), w in zip(SHAPES, tiles)],
            "torch": lambda: [F.linear(xs[k], w) for (_, k), w in zip(SHAPES, dense)],
        }, passes)
        emit({"bench": "avx2_linear", "rows": rows, "ours_ms": round(1e3 * t["ours"], 2),
              "torch_bf16_ms": round(1e3 * t["torch"], 2),
              "ours_gflop_per_s": round(2 * rows * sum(n * k for n, k in SHAPES) / t["ours"] / 1e9, 1),
              "speed_ratio_ours_over_torch": round(t["torch"] / t["ours"], 2)})


def quantized_linears(rows_list: list[int], passes: int, torch_paths: bool) -> None:
    group = 128
    dense = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]
    tiles = [avx2_linear.pack(w) for w in dense]
    int4 = [int4_layout.pack(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // group) * 0.01,
                             torch.randint(0, 16, (n, k // group)), group) for n, k in SHAPES]
    fp8 = [fp8_layout.pack((w.float() * 2e4).clamp(-448, 448).to(torch.float8_e4m3fn),
                           torch.full((w.shape[0],), 5e-5)) for w in dense]
    buffer = torch.empty(max(n * k for n, k in SHAPES), dtype=torch.bfloat16)

    def via_tiles(dequantize, x, n, k):
        return avx2_linear.linear(x, dequantize(buffer[:n * k].view(n // 8, k, 8)))

    for rows in rows_list:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
        fns = {
            "bf16": lambda: [avx2_linear.linear(xs[k], w) for (_, k), w in zip(SHAPES, tiles)],
            "int4": lambda: [avx2_quantized.int4_linear(xs[k], *p, group) for (_, k), p in zip(SHAPES, int4)],
            "int4_via_bf16_tiles": lambda: [
                via_tiles(lambda out, p=p: avx2_quantized.int4_dequantize_tiles(*p, group, out), xs[k], n, k)
                for (n, k), p in zip(SHAPES, int4)],
            "fp8": lambda: [avx2_quantized.fp8_linear(xs[k], *p) for (_, k), p in zip(SHAPES, fp8)],
            "fp8_via_bf16_tiles": lambda: [
                via_tiles(lambda out, p=p: avx2_quantized.fp8_dequantize_tiles(*p, out), xs[k], n, k)
                for (n, k), p in zip(SHAPES, fp8)],
        }
        if torch_paths:  # what an AVX2 host ran before these kernels: the weight dequantized in torch per call
            fns["int4_torch"] = lambda: [F.linear(xs[k], int4_layout.dequantize(*p, group, torch.bfloat16))
                                         for (_, k), p in zip(SHAPES, int4)]
            fns["fp8_torch"] = lambda: [F.linear(xs[k], fp8_layout.dequantize(*p, torch.bfloat16))
                                        for (_, k), p in zip(SHAPES, fp8)]
        t = alternated(fns, passes)
        emit({"bench": "avx2_quantized_linear", "rows": rows,
              **{f"{name}_ms": round(1e3 * v, 2) for name, v in t.items()},
              **{f"speed_{name}_over_bf16": round(t["bf16"] / v, 2) for name, v in t.items() if name != "bf16"}})


def decode_attention(rows: int, context: int, passes: int, kv_dtype: str = "bf16") -> dict:
    g = torch.Generator().manual_seed(0)
    per_row = -(-context // BLOCK)
    blocks = rows * per_row + 1
    tables = (torch.randperm(blocks - 1, generator=g) + 1).view(rows, per_row)  # shuffled, as a busy pool's
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    cache = cache.to(torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16)
    lens = torch.full((rows,), context)
    pos = lens - 1
    slots = tables[torch.arange(rows), pos // BLOCK] * BLOCK + pos % BLOCK
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2))
    fns = {}
    for name, backend in (("ours", Avx2Attention()), ("torch", TorchAttention())):
        starts = list(range(rows + 1))
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=lens, query_start_loc=starts,
                                 query_start_loc_t=torch.tensor(starts, dtype=torch.int32), max_query_len=1,
                                 seq_lens_list=lens.tolist(), num_decodes=rows, block_size=BLOCK, backend=backend)
        fns[name] = (lambda b=backend, m=meta: b.forward(q, k, v, cache, m, HEAD_DIM ** -0.5, None))
    with torch.inference_mode():
        t = alternated(fns, passes)
    emit({"bench": "avx2_decode_attention", "kv_dtype": kv_dtype, "rows": rows, "context": context,
          "ours_ms": round(1e3 * t["ours"], 3), "torch_ms": round(1e3 * t["torch"], 3),
          "speed_ratio_ours_over_torch": round(t["torch"] / t["ours"], 2)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--contexts", default="8x128,8x384,32x384,8x1024")
    ap.add_argument("--quantized-rows", default="1,8,32,64,128,256")
    ap.add_argument("--kv-dtypes", default="bf16,fp8")
    ap.add_argument("--torch-paths", action="store_true", help="also time the torch dequantization (slow)")
    ap.add_argument("--passes", type=int, default=7)
    args = ap.parse_args()
    supported, why = avx2_linear.avx2_supported()
    if not supported:
        raise SystemExit(f"the AVX2 kernels do not run here: {why}")
    torch.manual_seed(0)
    with torch.inference_mode():
        linears([int(r) for r in args.rows.split(",") if r], args.passes)
        quantized_linears([int(r) for r in args.quantized_rows.split(",") if r], args.passes, args.torch_paths)
    for point in (p for p in args.contexts.split(",") if p):
        rows, context = (int(x) for x in point.split("x"))
        for kv_dtype in args.kv_dtypes.split(","):
            decode_attention(rows, context, args.passes, kv_dtype)


if __name__ == "__main__":
    main()
