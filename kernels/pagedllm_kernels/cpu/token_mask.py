"""Structured output's token masks on CPU logits (the C++ in token_mask.cpp): launcher and torch reference.

A bitmask row holds one bit per token (bit t of word t // 32, least significant first: xgrammar's and llguidance's layout);
a clear bit, or a token past the mask's width, sets that token's logit to -inf.
"""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import extension


def mask_logits_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: logits[rows[j]] masked by bitmask[j] (int32 [len(rows), words])."""
    if logits.dim() != 2 or not logits.is_contiguous() or logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"logits must be contiguous [rows, vocab] fp32 or bf16, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[0] != len(rows):
        raise ValueError(f"bitmask must be int32 [{len(rows)}, words], got {tuple(bitmask.shape)} {bitmask.dtype}")
    extension().mask_logits_(logits, torch.tensor(rows, dtype=torch.long), bitmask.contiguous())


_BITS = torch.arange(32, dtype=torch.int32)


def reference_mask_logits_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1).view(len(rows), -1).bool()
    if allowed.shape[1] < vocab:  # tokens past the mask: not allowed
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - allowed.shape[1])], dim=1)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))
