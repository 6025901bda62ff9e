"""pagedllm: a paged-KV LLM engine with a vLLM-shaped offline API and a Triton Python backend.

The public names load on first use, so a process that needs none of them (the OpenAI front end, the client
side of a test) does not import torch and the engine just by importing a `pagedllm` module."""

from __future__ import annotations

import importlib

_PUBLIC = {"LLM": "pagedllm.llm", "SamplingParams": "pagedllm.sampling_params",
           "BeamSearchParams": "pagedllm.sampling_params", "LoRARequest": "pagedllm.lora_request",
           "RequestOutput": "pagedllm.outputs", "CompletionOutput": "pagedllm.outputs"}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
