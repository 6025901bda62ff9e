"""bf16 linears on CPU as a decode step sees them: the 125M model's 49 linears (12 layers of q/k/v, o, gate/up,
down, then the LM head), each with its own weight so they stream from memory as in a forward pass, through our
AVX512-BF16 kernel (bf16_tiles.py) and through oneDNN's packed matmul (PackedLinear's other path), alternated
pass by pass in one process; per row count the median pass of each, their ratio, and whether PackedLinear
sends that many rows to our kernel (`bf16_tiles.MAX_ROWS`).

    .venv/bin/python perf/bf16_linear.py [--rows 1,2,4,8,16,32,64,128,256,512] [--passes 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import emit
from pagedllm.models.layers.packed_linear import pack_weight, packed_matmul
from pagedllm_kernels.cpu import bf16_tiles

LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # 125M: (out, in) of qkv, o, gate_up, down
SHAPES = LAYER * 12 + [(32000, 768)]


def one_pass(rows: int, weights: list, linear) -> float:
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
    start = time.perf_counter()
    for (_, k), w in zip(SHAPES, weights):
        linear(xs[k], w)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--passes", type=int, default=12)
    args = ap.parse_args()
    supported, why = bf16_tiles.cpu_supported()
    if not supported:
        raise SystemExit(f"our bf16 kernel does not run here: {why}")
    torch.manual_seed(0)
    dense = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]
    ours = [bf16_tiles.pack(w) for w in dense]
    onednn = [pack_weight(w) for w in dense]
    weight_bytes = sum(w.numel() * w.element_size() for w in dense)
    del dense
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            one_pass(rows, ours, bf16_tiles.linear)  # warm-up
            one_pass(rows, onednn, packed_matmul)  # oneDNN builds its primitive for this shape
            times = {"ours": [], "onednn": []}
            for _ in range(args.passes):
                times["ours"].append(one_pass(rows, ours, bf16_tiles.linear))
                times["onednn"].append(one_pass(rows, onednn, packed_matmul))
            a, b = statistics.median(times["ours"]), statistics.median(times["onednn"])
            emit({"rows": rows, "ours_ms": round(1e3 * a, 2), "onednn_ms": round(1e3 * b, 2),
                  "ours_gb_per_s": round(weight_bytes / a / 1e9, 1),
                  "ours_gflop_per_s": round(rows * weight_bytes / a / 1e9, 1),  # 2 FLOPs per 2-byte weight and row
                  "speed_ratio_ours_over_onednn": round(b / a, 3), "our_kernel_in_use": rows <= bf16_tiles.MAX_ROWS})


if __name__ == "__main__":
    main()
