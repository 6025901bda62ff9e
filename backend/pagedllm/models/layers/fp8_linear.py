"""FP8 (e4m3) weight linears for `fp8` and compressed-tensors checkpoints (models/quantization/config.py).

The weight stays in fp8, in the kernels' layout (pagedllm_kernels/fp8_layout.py), with one scale per output
column (a per-tensor scale, or each fused shard's, repeated over its columns). Activations are rounded to e4m3
first when the checkpoint says so: at its static input_scale (the largest of a fused layer's shards, as vLLM
does), or at a dynamic per-tensor or per-token scale (max |x| / 448), by a C++ kernel on CPUs (AVX-512 or
AVX2).

On a GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper) a layer whose activations are rounded
multiplies the e4m3 codes themselves (torch._scaled_mm, cuBLASLt / CUTLASS), the weight kept as the checkpoint's
[N, K] rows: bf16 models with row-wise scales (x's per row, the weight's per column) applied in the GEMM's
epilogue, fp16 and fp32 ones with the scales applied to its fp32 output. Elsewhere the matmul widens the
weight: our Triton kernel on a GPU, our C++ kernel for bf16 on CPU
(which has no fp8 arithmetic) at every batch size (1.1-1.2x bf16 oneDNN's time on prefill-sized batches,
where dequantizing in torch per call cost far more: perf/quantized_linear.py); on CPUs without AVX-512 our AVX2
kernel (the same layout) up to AVX2_KERNEL_ROWS rows, above that the weight widened per call into the model's
shared buffer as tiles for the AVX2 bf16 kernel; the weight dequantized in torch for fp32 models.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.models.layers.staged_linear import StagedLinear
from pagedllm.models.quantization.config import Fp8Config
from pagedllm_kernels.cpu.build import avx2_module, kernel_module
from pagedllm_kernels.cpu.weight_buffer import WeightBuffer

logger = logging.getLogger(__name__)

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
AVX2_KERNEL_ROWS = 8  # measured on Zen 3: above this, widening into bf16 tiles per call wins (perf/avx2_kernels.py)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 matrices natively (CUDA compute capability 8.9 and up)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


class Fp8Linear(StagedLinear):
    def __init__(self, in_features: int, out_features: int, output_sizes: list[int] | None, bias: bool,
                 config: Fp8Config) -> None:
        names = ["weight", "weight_scale"] + (["input_scale"] if config.activations == "static" else [])
        super().__init__(in_features, out_features, output_sizes, bias, names)
        self.config = config
        self.input_scale_value: float | None = None
        self.tensor_cores = False  # set by finish: e4m3 x e4m3 on the GPU's tensor cores (weight kept as [N, K])

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
        weight, col_scales = torch.cat(weights), torch.cat(scales).float()
        device = self.take_staged()
        self.buffer = buffer
        if input_scales:
            self.input_scale_value = max(input_scales)
            self.register_buffer("input_scale", torch.tensor(self.input_scale_value, device=device))
        # _scaled_mm's shapes: K and N multiples of 16; activations must be e4m3 codes already (weight-only
        # checkpoints keep bf16 activations, which only the widening kernels take)
        if (self.config.activations is not None and fp8_tensor_cores(device)
                and self.in_features % 16 == 0 and self.out_features % 16 == 0):
            rows, row_scales = weight.to(device).contiguous(), col_scales.to(device)  # [N, K] (.t() column-major), [N]
            self.tensor_cores = self._tensor_cores_agree(rows, row_scales)
        if self.tensor_cores:
            self.register_buffer("weight_rows", rows)
            self.register_buffer("scales", row_scales)
        else:
            packed, packed_scales = fp8_layout.pack(weight, col_scales)
            self.register_buffer("packed", packed.to(device))
            self.register_buffer("scales", packed_scales.to(device))

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
        codes, scale = self.input_codes(x)
        return (codes.float() * scale).to(x.dtype)

    def input_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] as e4m3 codes and their fp32 scale ([M, 1] per token, else one value): x ~ codes * scale."""
        mode = self.config.activations
        if mode == "static":
            scale = self.input_scale
        else:
            amax = x.abs().amax(dim=-1, keepdim=True) if mode == "dynamic_token" else x.abs().amax()
            scale = (amax.float() / FP8_MAX).clamp_min(1e-12)
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        y = (self._tensor_core_matmul(x, self.weight_rows, self.scales) if self.tensor_cores
             else self._matmul(self.quantize_input(x)))
        return y.reshape(*shape[:-1], self.out_features)

    def _tensor_cores_agree(self, weight: torch.Tensor, scales: torch.Tensor) -> bool:
        """Probe _scaled_mm once per layer at load, in both of its modes, against the widened weight: a library
        that refuses these shapes or disagrees leaves the layer on the widening kernels (logged), not broken."""
        try:
            widened = weight.float() * scales[:, None]
            for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-3)):
                x = torch.randn(3, self.in_features, device=weight.device, dtype=dtype)
                want = self.quantize_input(x).float() @ widened.t()
                got = self._tensor_core_matmul(x, weight, scales).float()
                if self.bias is not None:
                    want = want + self.bias
                if not (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()):
                    raise RuntimeError(f"{dtype} output off by {(got - want).abs().max().item():g}")
            return True
        except Exception as e:  # noqa: BLE001 - any failure: the widening kernels still serve the layer
            logger.warning("fp8 tensor cores: off for a %dx%d layer (%s: %s); the widening kernel serves it",
                           self.out_features, self.in_features, type(e).__name__, e)
            return False

    def _tensor_core_matmul(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x's e4m3 codes times those of `weight` ([N, K] e4m3, its per-column `scales` [N]) on the tensor cores,
        accumulated in fp32 (as the widening paths do)."""
        codes, scale = self.input_codes(x)
        if x.dtype == torch.bfloat16:  # CUTLASS's row-wise kernel: the scales in its epilogue, bf16 out
            rows_scale = scale if scale.dim() == 2 else scale.reshape(1, 1).repeat(x.shape[0], 1)  # [M, 1], unit stride
            y = torch._scaled_mm(codes, weight.t(), scale_a=rows_scale, scale_b=scales.view(1, -1),
                                 out_dtype=torch.bfloat16)
        else:  # row-wise scaling has bf16 output only: unit scales, fp32 out, then the scales
            one = scales.new_ones(())
            y = torch._scaled_mm(codes, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            y = y * scale * scales
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

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
