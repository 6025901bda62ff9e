"""Which decoder ops go through our fused C++ CPU kernels (pagedllm_kernels.cpu.fused_ops): bfloat16 CPU
tensors, when the kernels can be built here. fp32 stays on the torch expressions, the path held
token-identical to transformers (as PackedLinear does). PAGEDLLM_FUSED_CPU_OPS=0 switches them off (for
A/B measurements)."""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _ops():
    if os.environ.get("PAGEDLLM_FUSED_CPU_OPS", "1") == "0":
        return None
    try:
        from pagedllm_kernels.cpu import build, fused_ops

        build.extension()
        return fused_ops
    except Exception as e:  # no AVX-512, compiler or ninja: the torch expressions do the work
        logger.info("fused CPU ops unavailable (%s: %s); using torch ops", type(e).__name__, e)
        return None


def ops_for(x: torch.Tensor):
    """The fused-ops module when x should use it, else None."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return _ops()
