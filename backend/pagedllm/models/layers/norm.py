"""RMSNorm, computed in fp32 like the HF reference (the product is cast back before the weight multiply).

Given a residual, the norm first adds it: `norm(x, residual)` returns (RMSNorm(x + residual), x + residual),
the decoder's residual add and the next layer's norm in one call (one pass in place on the fused CPU path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.fused import fused_for


class RMSNorm(nn.Module):
    fused_ops = None  # set by use_fused_ops

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fused = fused_for(self.fused_ops, x)
        if residual is not None:
            if fused is not None and x.is_contiguous() and residual.is_contiguous():
                return fused.add_rms_norm_(x, residual, self.weight, self.eps)  # x, residual: overwritten
            residual = x + residual
            return self._norm(residual), residual
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
