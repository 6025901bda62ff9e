"""Weight-only int4 linear layers for AWQ and GPTQ checkpoints (models/quantization/): each takes its
checkpoint tensors (qweight, qzeros, scales, g_idx; one set per fused shard) through the loader, and `finish`
turns them into the kernels' layout (pagedllm_kernels/int4_layout.py) once all have arrived.

A step runs where the weight stays packed and is dequantized inside the matmul: our Triton kernel on a GPU; on
CPU for bf16, our AVX512-BF16 kernel up to CPU_KERNEL_ROWS rows (decodes), or on CPUs without AVX-512 our AVX2
kernel up to AVX2_KERNEL_ROWS. Larger CPU batches are compute-bound: their weight is dequantized into one buffer
the model's layers share, for oneDNN's matmul (AVX2: as tiles for our AVX2 bf16 kernel, since oneDNN has no bf16
matmul there); one pass over the weight per call, and the model keeps only the packed copy. fp32 models (the
oracle's) dequantize in torch.
"""

from __future__ import annotations

import torch

from pagedllm.models.layers.staged_linear import StagedLinear
from pagedllm.models.quantization.config import Int4Config
from pagedllm.models.quantization.int4_formats import Int4Weight, group_index, unpack_awq, unpack_gptq
from pagedllm_kernels.cpu.build import avx2_module, kernel_module
from pagedllm_kernels.cpu.weight_buffer import WeightBuffer

CPU_KERNEL_ROWS = 64  # measured: above this, dequantize + oneDNN is faster on the 125M shapes (perf/README.md)
AVX2_KERNEL_ROWS = 8  # measured on Zen 3: above this, dequantize + the AVX2 bf16 kernel (perf/avx2_kernels.py)


class Int4Linear(StagedLinear):
    def __init__(self, in_features: int, out_features: int, output_sizes: list[int] | None, bias: bool,
                 config: Int4Config) -> None:
        names = ["qweight", "qzeros", "scales"] + (["g_idx"] if config.method == "gptq" else [])
        super().__init__(in_features, out_features, output_sizes, bias, names)
        self.config = config
        self.group_size = -1
        self.perm: torch.Tensor | None = None

    def finish(self, buffer: WeightBuffer) -> None:
        """The staged checkpoint tensors -> the kernels' layout; the placeholders go."""
        from pagedllm_kernels import int4_layout

        shards = self.shard_sizes()
        parts = [self._unpack(s) for s, _ in shards]
        if any(not torch.equal(p.g_idx, parts[0].g_idx) for p in parts[1:]):
            raise ValueError("int4: the fused projections (q/k/v or gate/up) have different g_idx; they share one "
                             "input, so GPTQ's activation order gives them the same one")
        self.group_size = gs = self.in_features if self.config.group_size == -1 else self.config.group_size
        groups = self.in_features // gs
        for part, (_, size) in zip(parts, shards):
            if part.codes.shape != (size, self.in_features):
                raise ValueError(f"int4: a shard holds {tuple(part.codes.shape)} codes, expected "
                                 f"({size}, {self.in_features})")
            if part.scales.shape != (size, groups) or part.zeros.shape != (size, groups):
                raise ValueError(f"int4: scales {tuple(part.scales.shape)} and zeros {tuple(part.zeros.shape)} do "
                                 f"not hold {groups} groups of {gs} inputs for {size} outputs")
        w = Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.zeros for p in parts]),
                       torch.cat([p.scales for p in parts]), parts[0].g_idx)
        codes, zeros, scales, group = _contiguous_groups(w, self.config.group_size)
        if group is not w.g_idx:  # desc_act: the input rows were reordered to make the groups contiguous
            self.perm = group
        packed, s, m = int4_layout.pack(codes, scales, zeros.float(), self.group_size)
        device = self.take_staged()
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales", s.to(device))
        self.register_buffer("mins", m.to(device))
        if self.perm is not None:
            self.perm = self.perm.to(device)
        self.buffer = buffer

    def _unpack(self, shard) -> Int4Weight:
        t = self.staged(shard)
        if self.config.method == "awq":
            return unpack_awq(t["qweight"], t["qzeros"], t["scales"], self.config.group_size)
        return unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        y = self._matmul(x)
        return y.reshape(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagedllm_kernels.int4_matmul import int4_matmul

            return int4_matmul(x, self.packed, self.scales, self.mins, self.group_size, self.bias)
        kernel = kernel_module("int4_linear") if x.dtype == torch.bfloat16 else None
        if kernel is not None:
            if x.shape[0] <= CPU_KERNEL_ROWS:
                return kernel.linear(x, self.packed, self.scales, self.mins, self.group_size, self.bias)
            return self.dense(x, kernel.dequantize_into(self.packed, self.scales, self.mins, self.group_size,
                                                        self.buffer.view(self.out_features, self.in_features)))
        avx2 = avx2_module("avx2_quantized") if x.dtype == torch.bfloat16 else None
        if avx2 is not None:
            if x.shape[0] <= AVX2_KERNEL_ROWS:
                return avx2.int4_linear(x, self.packed, self.scales, self.mins, self.group_size, self.bias)
            return self.through_avx2_tiles(x, lambda out: avx2.int4_dequantize_tiles(
                self.packed, self.scales, self.mins, self.group_size, out))
        from pagedllm_kernels.int4_layout import dequantize

        return self.dense(x, dequantize(self.packed, self.scales, self.mins, self.group_size, x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.config.method}, "
                f"group_size={self.config.group_size}, desc_act={self.config.desc_act}")


def _contiguous_groups(w: Int4Weight, group_size: int):
    """(codes, zeros, scales, order): with groups already k // group_size, order is w.g_idx itself; else the
    input rows sorted by group (GPTQ desc_act), order being the permutation the input must go through."""
    k = w.codes.shape[1]
    plain = group_index(k, group_size)
    if torch.equal(w.g_idx, plain):
        return w.codes, w.zeros, w.scales, w.g_idx
    order = torch.argsort(w.g_idx, stable=True)
    if not torch.equal(w.g_idx[order], plain):
        raise ValueError(f"int4: g_idx does not give every group {group_size} input rows")
    return w.codes[:, order].contiguous(), w.zeros, w.scales, order
