"""Where a model's config, tokenizer and end-of-sequence ids come from, for both checkpoint kinds: an HF directory
(config.json, safetensors, tokenizer files) or a llama.cpp `.gguf` file (everything in its metadata, read through
transformers' GGUF support). Every part of pagedllm that opens a checkpoint goes through here."""

from __future__ import annotations

import copy
import functools
import os

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagedllm.models.gguf_checkpoint import ARCHITECTURES, gguf_location, metadata_overrides


def gguf_file(model: str) -> str | None:
    """The .gguf file `model` names (a file, or a directory holding one), or None for an HF directory."""
    where = gguf_location(model)
    return os.path.join(*where) if where else None


def load_config(model: str):
    where = gguf_location(model)
    if where is None:
        return AutoConfig.from_pretrained(model)
    arch, overrides = metadata_overrides(os.path.join(*where))  # refuses an architecture we cannot build
    hf = AutoConfig.from_pretrained(where[0], gguf_file=where[1])
    for key, value in overrides.items():
        setattr(hf, key, value)
    hf.architectures = [ARCHITECTURES[arch]]
    # GGUF weights are dequantized at load; with dtype "auto" they load as bfloat16 (the file names no dtype).
    hf.dtype = torch.bfloat16
    return hf


def load_tokenizer(model: str, tokenizer: str | None = None):
    """The tokenizer at `tokenizer` if given, else the model's (a GGUF file's comes from its metadata, chat
    template included). Each call returns a tokenizer of its own (callers use theirs on their own thread)."""
    source = tokenizer or model
    where = gguf_location(source)
    if where is None:
        return AutoTokenizer.from_pretrained(source)
    # Building one from GGUF metadata takes seconds (the vocabulary is parsed in Python); copying is quick.
    return copy.deepcopy(_gguf_tokenizer(*where, os.path.getmtime(os.path.join(*where))))


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(directory: str, name: str, mtime: float):
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def eos_token_ids(model: str, hf_config, tokenizer) -> set[int]:
    """generation_config.json's eos ids (HF directories), else the config's, else the tokenizer's."""
    eos = None
    if gguf_location(model) is None:
        try:
            eos = GenerationConfig.from_pretrained(model).eos_token_id
        except OSError:
            pass
    if eos is None:
        eos = hf_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
