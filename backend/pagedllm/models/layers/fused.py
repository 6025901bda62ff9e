"""The fused C++ CPU ops (pagedllm_kernels.cpu.fused_ops) for the decoder's bf16 CPU tensors.

Whether a model uses them is its builder's choice (`EngineConfig.fused_cpu_ops`): `use_fused_ops(model, ops)` is
a transform over a built model that hands the ops to every layer that can use them (those with a `fused_ops`
attribute). A layer keeps the torch expressions for any tensor that is not bf16 on the CPU: fp32 is the path
held token-identical to transformers.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch
from torch import nn

logger = logging.getLogger(__name__)


def load_fused_ops(device: str = "cpu") -> ModuleType | None:
    """The fused-ops module for a model on `device`, or None: off the CPU (nothing is built there), or (the reason
    logged) where it cannot be built here: no AVX-512, no compiler, no ninja."""
    return _load_cpu_kernels("fused_ops", device)


def load_token_mask(device: str = "cpu") -> ModuleType | None:
    """The token-mask kernel's module (structured output's masks on CPU logits), or None likewise."""
    return _load_cpu_kernels("token_mask", device)


def load_decoder_loop(device: str = "cpu") -> ModuleType | None:
    """The C++ loop over the decoder's layers (models/decoder_loop.py), or None likewise."""
    return _load_cpu_kernels("decoder_loop", device)


def load_lora_kernel(device: str = "cpu") -> ModuleType | None:
    """The batched LoRA delta kernel's module (bf16 on CPU), or None likewise."""
    return _load_cpu_kernels("lora", device)


def _load_cpu_kernels(name: str, device: str) -> ModuleType | None:
    if device != "cpu":  # a GPU engine's tensors never reach them: no build for nothing
        return None
    try:
        from pagedllm_kernels.cpu import build

        build.extension()
        return importlib.import_module(f"pagedllm_kernels.cpu.{name}")
    except Exception as e:
        logger.info("CPU kernels (%s) unavailable (%s: %s); using torch ops", name, type(e).__name__, e)
        return None


def fused_for(ops: ModuleType | None, x: torch.Tensor) -> ModuleType | None:
    """`ops` when x should go through them (bf16 on the CPU), else None."""
    if ops is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return ops


def use_fused_ops(model: nn.Module, ops: ModuleType | None) -> int:
    """Give `ops` (None: the torch expressions) to every layer of `model` that can use them; returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "fused_ops")]
    for layer in layers:
        layer.fused_ops = ops
    return len(layers)
