"""Chooses the attention backend named in the engine config."""

from __future__ import annotations

import logging

from pagedllm.attention.torch_backend import TorchAttention

logger = logging.getLogger(__name__)

BACKENDS = {"torch": TorchAttention}


def select_backend(name: str):
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    logger.info("attention backend: %s", name)
    return BACKENDS[name]()
