"""Fused CPU ops for the decoder (the C++ in fused_ops.cpp): RMSNorm (alone, or after the residual add),
SiLU-and-mul, rotary in place, and the greedy sampler's argmax. Each has a launcher that checks its inputs
and a torch reference beside it (the expressions the model uses otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm_kernels.cpu.build import extension


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape[-1] != weight.shape[0] or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} disagree")
    return extension().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), eps).view(x.shape)


def reference_rms_norm(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual, then x <- RMSNorm(residual), both in place and in one pass; returns
    (x, residual). Both must be contiguous, of one shape and dtype."""
    if x.shape != residual.shape or x.dtype != residual.dtype or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype} and "
                         f"weight {weight.dtype} disagree")
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("x and residual must be contiguous (they are updated in place)")
    extension().add_rms_norm_(x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1]), weight.contiguous(), eps)
    return x, residual


def reference_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return reference_rms_norm(s, weight, eps), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must hold gate and up halves")
    y = extension().silu_and_mul(x.reshape(-1, x.shape[-1]).contiguous())
    return y.view(*x.shape[:-1], x.shape[-1] // 2)


def reference_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> [rows] int64: each row's largest value's index, the first one on ties."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, n], got {tuple(x.shape)}")
    return extension().argmax(x.contiguous())


def reference_argmax(x):
    return x.max(dim=-1).indices


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (rows may be strided views) rotated in place with cos, sin [T, 1, D/2]; returns x."""
    if x.dim() != 3 or x.shape[-1] % 32 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, heads, head_dim] with head_dim a multiple of 32, got {tuple(x.shape)}")
    extension().rotary_(x, cos.reshape(x.shape[0], -1).contiguous(), sin.reshape(x.shape[0], -1).contiguous())
    return x


def reference_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
