"""Quantized linears on CPU, side by side in one run, per row count.

Per layer (the 125M model's shapes, each weight cache-resident, best of 20): our C++ int4 kernel (dequantizing
inside the matmul), the int4 dequantize-then-oneDNN path, our C++ fp8-weight kernel, our int8 kernel, and the
bf16 layer they replace (oneDNN-packed, as pack_linears makes it). Sets CPU_KERNEL_ROWS in
models/layers/int4_linear.py (fp8 uses its kernel at every size).

`--stream`: as a decode step sees them, a model's linears (bf16_linear.py's shapes, the LM head left out), each
its own weight so they stream from memory: our int4 and fp8 kernels against the bf16 layers (PackedLinear, as
the load-time race left it), or (`--against OLD.cpp`, another build of quantized_linear.cpp) against that
build's int4 and fp8 kernels; alternated pass by pass, the median pass.

    .venv/bin/python perf/quantized_linear.py [--rows 1,8,32,64,128,256]
    .venv/bin/python perf/quantized_linear.py --stream [--model 0.5b] [--rows 1,2,4,8,16,64] [--against /tmp/old.cpp]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bf16_linear import LAYERS, model_shapes, one_pass
from common import build_kernel_module, emit
from pagedllm.models.layers.packed_linear import PackedLinear, pack_linears
from pagedllm_kernels import fp8_layout, int4_layout
from pagedllm_kernels.cpu import fp8_linear, int8_linear
from pagedllm_kernels.cpu import int4_linear as kernel

SHAPES = {"qkv": (1280, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048)}  # 125M: N, K


def best_ms(fn, repeats=20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)  # a noisy host only ever adds time


def random_int4(n: int, k: int, g: int):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return int4_layout.pack(codes, torch.rand(n, k // g) * 0.01, torch.randint(0, 16, (n, k // g)), g)


def random_fp8(n: int, k: int):
    return fp8_layout.pack((torch.randn(n, k) * 50).to(torch.float8_e4m3fn), torch.rand(n) * 0.01)


def build_other(source: str):
    """`source` (a quantized_linear.cpp) built beside our headers: its int4 and fp8 linears, as ours are called."""
    other = build_kernel_module(source, ["int4_linear", "fp8_linear"], "#include <optional>\n"
                                "torch::Tensor int4_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, "
                                "int64_t, std::optional<torch::Tensor>);\n"
                                "torch::Tensor fp8_linear(torch::Tensor, torch::Tensor, torch::Tensor, "
                                "std::optional<torch::Tensor>);")
    return (lambda x, w: other.int4_linear(x, *w, None)), (lambda x, w: other.fp8_linear(x, *w, None))


def stream(args) -> None:
    shapes = model_shapes(args.model)[:-1]
    g = args.group_size
    torch.manual_seed(0)
    int4_weights = [random_int4(n, k, g) + (g,) for n, k in shapes]
    fp8_weights = [random_fp8(n, k) for n, k in shapes]
    paths = {"int4": (int4_weights, lambda x, w: kernel.linear(x, *w)),
             "fp8": (fp8_weights, lambda x, w: fp8_linear.linear(x, *w))}
    if args.against:
        other_int4, other_fp8 = build_other(args.against)
        paths |= {"other_int4": (int4_weights, other_int4), "other_fp8": (fp8_weights, other_fp8)}
    else:
        bf16 = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for n, k in shapes)
        pack_linears(bf16)  # as a model's load makes them: our tiles kernel or oneDNN per the race
        paths["bf16"] = (list(bf16), lambda x, layer: layer(x))
    nbytes = {"int4": sum(w[0].numel() for w in int4_weights), "fp8": sum(w[0].numel() for w in fp8_weights)}
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            for weights, fn in paths.values():  # warm-up
                one_pass(rows, shapes, weights, fn)
            times = {name: [] for name in paths}
            for i in range(args.passes):
                for name in (list(paths) if i % 2 == 0 else list(paths)[::-1]):  # a drifting host favours none
                    times[name].append(one_pass(rows, shapes, *paths[name]))
            med = {name: statistics.median(t) for name, t in times.items()}
            ratios = {f"speed_ratio_{f}_over_{other}": round(med[other] / med[f], 3) for f in ("int4", "fp8")
                      for other in (["bf16"] if "bf16" in med else [f"other_{f}"])}
            emit({"bench": "quantized_linear_stream", "model": args.model, "rows": rows,
                  **{f"{name}_ms": round(1e3 * t, 2) for name, t in med.items()},
                  **{f"{f}_gb_per_s": round(nbytes[f] / med[f] / 1e9, 1) for f in nbytes}, **ratios})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="per layer: 1,8,32,64,128,256; --stream: 1,2,4,8,16,64")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--stream", action="store_true", help="a model's linears streamed, as a decode step sees them")
    ap.add_argument("--model", default="125m", choices=sorted(LAYERS))
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--against", default=None, help="--stream: another quantized_linear.cpp, alternated with ours")
    args = ap.parse_args()
    if args.stream:
        args.rows = args.rows or "1,2,4,8,16,64"
        return stream(args)
    args.rows = args.rows or "1,8,32,64,128,256"
    g = args.group_size
    for name, (n, k) in SHAPES.items():
        packed, s, m = random_int4(n, k, g)
        dense = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        dense.weight.data = int4_layout.dequantize(packed, s, m, g, torch.bfloat16)
        packed_bf16 = PackedLinear(dense)
        buf = torch.empty(n, k, dtype=torch.bfloat16)
        w8, s8 = random_fp8(n, k)
        i8 = int8_linear.quantize_weight(dense.weight.data)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            with torch.inference_mode():
                t_kernel = best_ms(lambda: kernel.linear(x, packed, s, m, g))
                t_deq = best_ms(lambda: F.linear(x, kernel.dequantize_into(packed, s, m, g, buf)))
                t_fp8 = best_ms(lambda: fp8_linear.linear(x, w8, s8))
                t_int8 = best_ms(lambda: int8_linear.linear(x, *i8))
                t_bf16 = best_ms(lambda: packed_bf16(x))
            emit({"bench": "quantized_linear", "layer": name, "rows": rows, "int4_kernel_ms": round(t_kernel, 3),
                  "int4_dequant_onednn_ms": round(t_deq, 3), "fp8_kernel_ms": round(t_fp8, 3),
                  "int8_kernel_ms": round(t_int8, 3), "bf16_ms": round(t_bf16, 3), "kernel_over_bf16": round(t_kernel / t_bf16, 2),
                  "dequant_over_bf16": round(t_deq / t_bf16, 2), "fp8_over_bf16": round(t_fp8 / t_bf16, 2),
                  "int8_over_bf16": round(t_int8 / t_bf16, 2)})


if __name__ == "__main__":
    main()
