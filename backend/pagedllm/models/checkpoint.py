"""Where a model's config, tokenizer and end-of-sequence ids come from, for both checkpoint kinds: an HF directory
(config.json, safetensors, tokenizer files) or a llama.cpp `.gguf` file (everything in its metadata, converted
by transformers' GGUF support once per machine into an HF directory: pagedllm.models.gguf_metadata). Every part
of pagedllm that opens a checkpoint goes through here."""

from __future__ import annotations

import os

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagedllm.models.gguf_checkpoint import gguf_location
from pagedllm.models.gguf_metadata import converted_dir


def gguf_file(model: str) -> str | None:
    """The .gguf file `model` names (a file, or a directory holding one), or None for an HF directory."""
    where = gguf_location(model)
    return os.path.join(*where) if where else None


def load_config(model: str):
    where = gguf_location(model)
    return AutoConfig.from_pretrained(converted_dir(os.path.join(*where)) if where else model)


def load_tokenizer(model: str, tokenizer: str | None = None):
    """The tokenizer at `tokenizer` if given, else the model's (a GGUF file's comes from its metadata, chat
    template included). Each call returns a tokenizer of its own (callers use theirs on their own thread)."""
    source = tokenizer or model
    where = gguf_location(source)
    return AutoTokenizer.from_pretrained(converted_dir(os.path.join(*where)) if where else source)


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
