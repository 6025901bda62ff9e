"""Quantized linears on CPU at the 125M model's shapes, side by side in one run: our C++ int4 kernel
(dequantizing inside the matmul), the int4 dequantize-then-oneDNN path, our C++ fp8-weight kernel, and the bf16
layer they replace (oneDNN-packed, as pack_linears makes it), per row count. Sets CPU_KERNEL_ROWS in
models/layers/int4_linear.py (fp8 uses its kernel at every size).

    .venv/bin/python perf/quantized_linear.py [--rows 1,8,32,64,128,256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from common import emit
from pagedllm.models.layers.packed_linear import PackedLinear
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64,128,256")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    g = args.group_size
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales, zeros = torch.rand(n, k // g) * 0.01, torch.randint(0, 16, (n, k // g))
        packed, s, m = int4_layout.pack(codes, scales, zeros, g)
        dense = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        dense.weight.data = int4_layout.dequantize(packed, s, m, g, torch.bfloat16)
        packed_bf16 = PackedLinear(dense)
        buf = torch.empty(n, k, dtype=torch.bfloat16)
        w8, s8 = fp8_layout.pack((torch.randn(n, k) * 50).to(torch.float8_e4m3fn), torch.rand(n) * 0.01)
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
