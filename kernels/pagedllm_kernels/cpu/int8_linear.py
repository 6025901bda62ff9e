"""W8A8 int8 linear for AVX512-VNNI CPUs (the C++ in int8_linear.cpp), as vLLM's CPU backend offers it: weights
quantized once per output column (symmetric, max |w| / 127), activations per row at each call (dynamic
per-token, symmetric), int32 sums by vpdpbusd, one fp32 rescale per output."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import extension, vnni_supported

__all__ = ["vnni_supported", "quantize_rows", "quantize_weight", "linear", "reference"]

TILE = 16


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scales float32 [N]): each output row symmetric, max |w| / 127."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def quantize_weight(weight: torch.Tensor):
    """[N, K] float -> (packed int8 [N/16, K/4, 16, 4], scales float32 [N], wsum int32 [N])."""
    n, k = weight.shape
    if n % TILE or k % 16:
        raise ValueError(f"int8: output features {n} must be a multiple of 16 and input features {k} too")
    q, scales = quantize_rows(weight)
    packed = q.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, scales, q.sum(dim=1, dtype=torch.int32)


def linear(x: torch.Tensor, packed, scales, wsum, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] (bf16 or fp32) -> [rows, N] in x's dtype; bias float32 [N] or None."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] * 4:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {packed.shape[1] * 4} inputs")
    return extension().int8_linear(x if x.stride(1) == 1 else x.contiguous(), packed, scales, wsum, bias)


def reference(x, packed, scales, wsum, bias=None) -> torch.Tensor:
    """The same quantization in torch, integer sums in int64: what the kernel computes."""
    n = packed.shape[0] * TILE
    q = packed.permute(0, 2, 1, 3).reshape(n, -1).to(torch.int64)
    xf = x.float()
    xs = xf.abs().amax(dim=1, keepdim=True) / 127
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    xq = torch.round(xf * (1 / xs)).clamp(-127, 127).to(torch.int64)
    y = (xq @ q.t()).float() * xs * scales[None, :]
    return (y if bias is None else y + bias.float()).to(x.dtype)
