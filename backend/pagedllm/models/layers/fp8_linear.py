"""FP8 (e4m3) weight linears for `fp8` and compressed-tensors checkpoints (models/quantization/config.py).

The weight stays in fp8, in the kernels' layout (pagedllm_kernels/fp8_layout.py), with one scale per output
column (a per-tensor scale, or each fused shard's, repeated over its columns). Activations are rounded to e4m3
first when the checkpoint says so: at its static input_scale (the largest of a fused layer's shards, as vLLM
does), or at a dynamic per-tensor or per-token scale (max |x| / 448), by a C++ kernel on CPUs (AVX-512 or
AVX2). Then the matmul, where the weight is widened: our Triton kernel on a GPU, our C++ kernel for bf16 on CPU
(which has no fp8 arithmetic) at every batch size (1.1-1.2x bf16 oneDNN's time on prefill-sized batches,
where dequantizing in torch per call cost far more: perf/quantized_linear.py); on CPUs without AVX-512 our AVX2
kernel (the same layout) up to AVX2_KERNEL_ROWS rows, above that the weight widened per call into the model's
shared buffer as tiles for the AVX2 bf16 kernel; the weight dequantized in torch for fp32 models.
"""

from __future__ import annotations

import torch

from pagedllm.models.layers.staged_linear import StagedLinear
from pagedllm.models.quantization.config import Fp8Config
from pagedllm_kernels.cpu.build import avx2_module, kernel_module
from pagedllm_kernels.cpu.weight_buffer import WeightBuffer

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
AVX2_KERNEL_ROWS = 8  # measured on Zen 3: above this, widening into bf16 tiles per call wins (perf/avx2_kernels.py)


class Fp8Linear(StagedLinear):
    def __init__(self, in_features: int, out_features: int, output_sizes: list[int] | None, bias: bool,
                 config: Fp8Config) -> None:
        names = ["weight", "weight_scale"] + (["input_scale"] if config.activations == "static" else [])
        super().__init__(in_features, out_features, output_sizes, bias, names)
        self.config = config
        self.input_scale_value: float | None = None

    def finish(self, buffer: WeightBuffer) -> None:
        from pagedllm_kernels import fp8_layout

        weights, scales, input_scales = [], [], []
        for shard, size in self.shard_sizes():
            t = self.staged(shard)
            w = t["weight"]
            if w.dtype != FP8 or tuple(w.shape) != (size, self.in_features):
                raise ValueError(f"fp8 weights: expected float8_e4m3fn ({size}, {self.in_features}), the checkpoint "
                                 f"has {w.dtype} {tuple(w.shape)}")
            s = t["weight_scale"].float().reshape(-1)
            if s.numel() not in (1, size):
                raise ValueError(f"fp8 weights: weight_scale of {s.numel()} values for {size} output rows")
            weights.append(w)
            scales.append(s.expand(size) if s.numel() == 1 else s)
            if "input_scale" in t:
                input_scales.append(float(t["input_scale"].float().reshape(-1).max()))
        packed, col_scales = fp8_layout.pack(torch.cat(weights), torch.cat(scales))
        device = self.take_staged()
        self.buffer = buffer
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales", col_scales.to(device))
        if input_scales:
            self.input_scale_value = max(input_scales)
            self.register_buffer("input_scale", torch.tensor(self.input_scale_value, device=device))

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to e4m3 at the checkpoint's activation scale (and back to x's dtype)."""
        mode = self.config.activations
        if mode is None:
            return x
        static, per_token = (self.input_scale_value if mode == "static" else None), mode == "dynamic_token"
        if not x.is_cuda and x.dtype == torch.bfloat16:  # one pass in C++, where torch takes about nine ops
            kernel = kernel_module("fp8_linear")
            if kernel is not None and x.shape[-1] % 32 == 0:
                return kernel.round_input(x, static, per_token)
            avx2 = avx2_module("avx2_quantized")
            if avx2 is not None and x.shape[-1] % 8 == 0:
                return avx2.fp8_round_input(x, static, per_token)
        if mode == "static":
            scale = self.input_scale
        else:
            amax = x.abs().amax(dim=-1, keepdim=True) if mode == "dynamic_token" else x.abs().amax()
            scale = (amax.float() / FP8_MAX).clamp_min(1e-12)
        q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        return (q.float() * scale).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = self.quantize_input(x.reshape(-1, self.in_features))
        return self._matmul(x).reshape(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagedllm_kernels.fp8_matmul import fp8_matmul

            return fp8_matmul(x, self.packed, self.scales, self.bias)
        kernel = kernel_module("fp8_linear") if x.dtype == torch.bfloat16 else None
        if kernel is not None:
            return kernel.linear(x, self.packed, self.scales, self.bias)
        avx2 = avx2_module("avx2_quantized") if x.dtype == torch.bfloat16 else None
        if avx2 is not None:
            if x.shape[0] <= AVX2_KERNEL_ROWS:
                return avx2.fp8_linear(x, self.packed, self.scales, self.bias)
            return self.through_avx2_tiles(x, lambda out: avx2.fp8_dequantize_tiles(self.packed, self.scales, out))
        from pagedllm_kernels.fp8_layout import dequantize

        return self.dense(x, dequantize(self.packed, self.scales, x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.config.method}, "
                f"weights per {self.config.weight_strategy}, activations {self.config.activations}")
