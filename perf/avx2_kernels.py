"""The AVX2 kernels (CPUs without AVX-512) against the torch paths they replace, alternated pass by pass in one
process; per point the median pass of each and their ratio.

- linears: the 125M model's 49 linears as a forward pass streams them (each its own weight), our AVX2 kernel
  (avx2_linear.py) vs torch's bf16 F.linear, per row count;
- decode attention: one layer's step of decode rows over their paged contexts (125M's 12 heads of 64), the
  `avx2` backend vs the `torch` backend (its gather + SDPA), store included, per (rows, context).

    .venv/bin/python perf/avx2_kernels.py [--rows 1,2,4,8,16,32,64,256] [--contexts 8x128,8x384,32x384,8x1024]
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
from pagedllm_kernels.cpu import avx2_linear

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


def decode_attention(rows: int, context: int, passes: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per_row = -(-context // BLOCK)
    blocks = rows * per_row + 1
    tables = (torch.randperm(blocks - 1, generator=g) + 1).view(rows, per_row)  # shuffled, as a busy pool's
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
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
    emit({"bench": "avx2_decode_attention", "rows": rows, "context": context, "ours_ms": round(1e3 * t["ours"], 3),
          "torch_ms": round(1e3 * t["torch"], 3), "speed_ratio_ours_over_torch": round(t["torch"] / t["ours"], 2)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--contexts", default="8x128,8x384,32x384,8x1024")
    ap.add_argument("--passes", type=int, default=7)
    args = ap.parse_args()
    supported, why = avx2_linear.avx2_supported()
    if not supported:
        raise SystemExit(f"the AVX2 kernels do not run here: {why}")
    torch.manual_seed(0)
    with torch.inference_mode():
        linears([int(r) for r in args.rows.split(",") if r], args.passes)
    for point in (p for p in args.contexts.split(",") if p):
        rows, context = (int(x) for x in point.split("x"))
        decode_attention(rows, context, args.passes)


if __name__ == "__main__":
    main()
