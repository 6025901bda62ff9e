"""Room for one dequantized bf16 weight, for the quantized layers that hand oneDNN a plain weight on large
batches (the int4 and fp8 layers' dequantization)."""

from __future__ import annotations

import torch


class WeightBuffer:
    """Reused by every layer of one model (its layers run one at a time); grown to the largest weight on first
    use. Each model owns its buffer, so two models in a process never share one."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None

    def view(self, n: int, k: int) -> torch.Tensor:
        if self._data is None or self._data.numel() < n * k:
            self._data = torch.empty(n * k, dtype=torch.bfloat16)
        return self._data[:n * k].view(n, k)
