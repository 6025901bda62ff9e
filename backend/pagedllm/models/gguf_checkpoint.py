"""Reads a llama.cpp `.gguf` checkpoint: its tensors dequantized (by the `gguf` package, llama.cpp's own reader)
and renamed to the HF names our models load, with the Q/K row order llama.cpp's converter changed put back.

Supported: the llama family as llama.cpp writes it (`general.architecture` llama, which covers Llama and
Mistral, qwen2 and qwen3) and the tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and
Q6_K, all dequantized at load into the engine's dtype. The config and the tokenizer (with its chat template)
come from the file's metadata through transformers' GGUF support, converted once (pagedllm.models.gguf_metadata).

The tensors are read through a directory of them (name, type, dtype, shape, offset) that `gguf`'s reader
makes once, at that conversion, and the file memory-mapped directly afterwards: the reader parses every
metadata field first, the vocabulary's ~100k strings included (2.2 s per start for SmolLM2-135M, measured).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

# general.architecture -> the HF architecture our registry builds.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types we dequantize (llama.cpp's names); anything else is refused with its name.
SUPPORTED_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})
# Only llama.cpp's LlamaModel converter reorders Q and K rows; Qwen2/Qwen3 are written as HF stores them.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_location(path: str) -> tuple[str, str] | None:
    """(directory, file name) when `path` is a .gguf file, or a directory holding exactly one .gguf file and no
    HF config.json; None for an HF checkpoint directory."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(found) == 1:
            return os.path.abspath(path), found[0]
        if len(found) > 1:
            raise ValueError(f"model: {path} holds {len(found)} .gguf files; name one of them: {found[:4]}")
    return None


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not supported (only the llama family's tensors are)")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K reordering. HF Llama's rotary pairs dimension i with i + head_dim/2 (rotate_half);
    llama.cpp's kernels pair 2i with 2i+1, so its converter interleaves each head's two halves (rows
    [a0 a1 .. | b0 b1 ..] -> [a0 b0 a1 b1 ..]). This puts each head's rows back in HF order."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tensor_directory(reader) -> dict:
    """What finding and decoding the tensors takes, from a GGUFReader: the architecture and, per tensor, its
    name, type, and the dtype, shape and file offset of the array the reader maps for it."""
    return {"architecture": _architecture(reader),
            "tensors": [{"name": t.name, "type": t.tensor_type.name, "dtype": t.data.dtype.str,
                         "shape": list(t.data.shape), "offset": int(t.data_offset)} for t in reader.tensors]}


def dequantize(name: str, kind: str, data: np.ndarray) -> np.ndarray:
    """One tensor's mapped array as float32 numpy in its logical (rows, columns) shape."""
    from gguf import GGMLQuantizationType, quants

    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF tensor {name!r}: type {kind} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})")
    return np.asarray(quants.dequantize(data, GGMLQuantizationType[kind]), dtype=np.float32)


def gguf_tensors(path: str, hf_config, directory: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file, one at a time (each dequantized when reached).
    `directory`: the file's tensor_directory (None: read it from the file now)."""
    if directory is None:
        from gguf import GGUFReader

        directory = tensor_directory(GGUFReader(path))
    permuted = directory["architecture"] in _PERMUTED_ARCHITECTURES
    heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads}
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for entry in directory["tensors"]:
        if entry["name"] == "rope_freqs.weight":
            # Llama 3.1's rope scaling, stored as per-frequency factors: our rotary takes it from the config,
            # which transformers' GGUF reader does not fill in, so serving this file would be silently wrong.
            raise ValueError(f"{path}: rope_freqs (Llama 3 rope scaling in a GGUF file) is not supported")
        name = hf_tensor_name(entry["name"])
        dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
        size = dtype.itemsize * math.prod(shape)
        data = mapped[entry["offset"]:entry["offset"] + size].view(dtype).reshape(shape)
        weight = torch.from_numpy(dequantize(entry["name"], entry["type"], data).copy())  # the map is read-only
        kind = entry["name"].split(".")[-2]  # blk.N.<kind>.weight
        if permuted and kind in heads:
            weight = unpermute_rows(weight, heads[kind])
        yield name, weight


def metadata_overrides(reader) -> tuple[str, dict]:
    """(architecture, config fields transformers' GGUF reader leaves out), from a GGUFReader: the head
    dimension, which Qwen3 sets apart from hidden_size / heads and which transformers would take from its
    config class's default."""
    arch = _architecture(reader)
    key_length = reader.get_field(f"{arch}.attention.key_length")
    return arch, ({"head_dim": int(key_length.contents())} if key_length is not None else {})


def _architecture(reader) -> str:
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return arch
