"""bf16 linears on CPU as a decode step sees them: a model's linears (125M: 12 layers of q/k/v, o, gate/up, down,
then the LM head; or the 0.5B shape's 24 layers), each with its own weight so they stream from memory as in a
forward pass, through our AVX512-BF16 kernel (bf16_tiles.py; with and without its software prefetch), or with
`--kernel amx` our AMX one (amx_linear.py), and through oneDNN's packed matmul (PackedLinear's other path),
alternated pass by pass in one process, each first in turn; per row count the median pass of each, their ratios,
and whether PackedLinear may send that many rows to our kernel (`MAX_ROWS`; the load-time race decides).
`--against OLD.cpp` builds another version of quantized_linear.cpp (amx_linear.cpp with `--kernel amx`; e.g.
`git show REV:kernels/pagedllm_kernels/cpu/amx_linear.cpp > /tmp/old.cpp`) and alternates it with ours instead
of oneDNN.

    .venv/bin/python perf/bf16_linear.py [--rows 1,2,4,8,16,32,64,128,256,512] [--passes 12] [--model 0.5b]
    .venv/bin/python perf/bf16_linear.py --rows 8,16 --against /tmp/old.cpp
    .venv/bin/python perf/bf16_linear.py --kernel amx --rows 1,32,64,128 --against /tmp/old.cpp
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import time

import torch

from common import build_kernel_source, emit
from pagedllm.models.layers.packed_linear import pack_weight, packed_matmul
from pagedllm_kernels.cpu import amx_linear, bf16_tiles

LAYERS = {  # (out, in) of qkv, o, gate_up, down per layer; layers; the LM head
    "125m": ([(1280, 768), (768, 768), (4096, 768), (768, 2048)], 12, (32000, 768)),
    "0.5b": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24, (32000, 896)),
}


def model_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every linear a decode step streams, in order, the LM head last."""
    layer, layers, head = LAYERS[model]
    return layer * layers + [head]


SHAPES = model_shapes("125m")  # avx2_kernels.py times the same linears


def one_pass(rows: int, shapes: list, weights: list, linear) -> float:
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in shapes}}
    start = time.perf_counter()
    for (_, k), w in zip(shapes, weights):
        linear(xs[k], w)
    return time.perf_counter() - start


def build_other(source: str, kernel: str):
    """`source` (a quantized_linear.cpp, or with `kernel` "amx" an amx_linear.cpp) built beside our headers: its
    bf16_linear (amx_linear), as `(x, packed)`."""
    if kernel == "amx":
        other = build_kernel_source(source, "amx_linear")
        return lambda x, packed: other(x, packed, None)
    prefetch = re.search(r"bf16_linear\([^)]*bool prefetch", pathlib.Path(source).read_text()) is not None
    other = build_kernel_source(source, "bf16_linear",  # sources before the prefetch switch take no flag
                                "#include <optional>\ntorch::Tensor bf16_linear(torch::Tensor, torch::Tensor, "
                                "std::optional<torch::Tensor>" + (", bool" if prefetch else "") + ");")
    return lambda x, packed: other(x, packed, None, *([True] if prefetch else []))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--model", default="125m", choices=sorted(LAYERS))
    ap.add_argument("--kernel", default="avx512", choices=["avx512", "amx"],
                    help="ours: the AVX512-BF16 tiles (bf16_tiles.py) or, on AMX hosts, amx_linear.py's kernel")
    ap.add_argument("--against", default=None,
                    help="another quantized_linear.cpp (amx_linear.cpp with --kernel amx), alternated with ours")
    args = ap.parse_args()
    kernel = amx_linear if args.kernel == "amx" else bf16_tiles
    supported, why = amx_linear.amx_supported() if args.kernel == "amx" else bf16_tiles.cpu_supported()
    if not supported:
        raise SystemExit(f"our {args.kernel} bf16 kernel does not run here: {why}")
    shapes = model_shapes(args.model)
    torch.manual_seed(0)
    dense = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
    ours = [kernel.pack(w) for w in dense]
    if args.against:
        other_name, other_linear, others = "other", build_other(args.against, args.kernel), ours
    else:
        other_name, other_linear, others = "onednn", packed_matmul, [pack_weight(w) for w in dense]
    weight_bytes = sum(w.numel() * w.element_size() for w in dense)
    del dense
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            paths = {"ours": (ours, kernel.linear), other_name: (others, other_linear)}
            if not args.against and kernel.PREFETCH_SWITCH:  # without its software prefetch (the race's other choice)
                paths["ours_no_prefetch"] = (ours, lambda x, w: kernel.linear(x, w, prefetch=False))
            for weights, fn in paths.values():  # warm-up (oneDNN builds its primitive for this shape)
                one_pass(rows, shapes, weights, fn)
            times = {name: [] for name in paths}
            for p in range(args.passes):  # alternated, each path first in turn
                for name, (weights, fn) in (list(paths.items()) if p % 2 == 0 else list(paths.items())[::-1]):
                    times[name].append(one_pass(rows, shapes, weights, fn))
            med = {name: statistics.median(t) for name, t in times.items()}
            a = med["ours"]
            emit({"model": args.model, "rows": rows, **{f"{n}_ms": round(1e3 * t, 2) for n, t in med.items()},
                  **{f"{n}_gb_per_s": round(weight_bytes / t / 1e9, 1) for n, t in med.items()},
                  "ours_gflop_per_s": round(rows * weight_bytes / a / 1e9, 1),  # 2 FLOPs per 2-byte weight and row
                  **{f"speed_ratio_ours_over_{n}": round(t / a, 3) for n, t in med.items() if n != "ours"},
                  "our_kernel_may_take_it": rows <= kernel.MAX_ROWS})


if __name__ == "__main__":
    main()
