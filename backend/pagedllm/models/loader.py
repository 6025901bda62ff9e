"""Builds a registered model from its HF config and fills it from (possibly sharded) safetensors files or a
.gguf file (dequantized, pagedllm.models.gguf_checkpoint).

Two separate steps, so that a caller can transform the built model before its weights load (the tensor-parallel
transform makes each layer read only its rank's slice) and after (packing linears, fused ops): the caller
composes them (pagedllm.engine.executor.worker); nothing here knows about parallelism.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from pagedllm.models.checkpoint import gguf_file
from pagedllm.models.gguf_checkpoint import gguf_tensors
from pagedllm.models.registry import resolve_model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def build_model(hf_config, device: str = "cpu") -> torch.nn.Module:
    """The registered architecture's model, built on `device` with uninitialised weights, in eval mode."""
    with torch.device(device):
        return resolve_model_class(hf_config)(hf_config).eval()


def load_weights(model: torch.nn.Module, model_dir: str, dtype: torch.dtype) -> None:
    """Cast `model` to dtype and fill every parameter from the checkpoint; a layer with a `load_weight` method
    reads its own part of a tensor (a lazy slice). Raises ValueError for a tensor with no place, a wrong shape,
    or a parameter the checkpoint lacks."""
    model.to(dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    loaded: set[str] = set()
    for name, ckpt in _checkpoint_tensors(model_dir, model.config):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard = _map_name(model, name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[target]
        custom = getattr(modules[target.rsplit(".", 1)[0]], "load_weight", None)
        if custom is not None:
            custom(param, shard, ckpt)
        else:
            shape = tuple(ckpt.shape) if isinstance(ckpt, torch.Tensor) else tuple(ckpt.get_shape())
            if tuple(param.shape) != shape:
                raise ValueError(f"{name}: shape {shape} != expected {tuple(param.shape)}")
            param.data.copy_(ckpt[:])
        loaded.add(target if shard is None else f"{target}#{shard}")
    _check_complete(params, modules, loaded, tied)


def _checkpoint_tensors(model_dir: str, hf_config):
    """(name, tensor) pairs: safetensors' are lazy slices (a sharded layer reads only its rows or columns), a
    GGUF file's are dense tensors, dequantized one at a time."""
    path = gguf_file(model_dir)
    if path is not None:
        yield from gguf_tensors(path, hf_config)
        return
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _map_name(model, name: str) -> tuple[str, int | None]:
    for ckpt, (ours, shard) in model.packed_modules.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{ours}."), shard
    return name, None


def _check_complete(params, modules, loaded: set[str], tied: bool) -> None:
    expected = set()
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        module = name.rsplit(".", 1)[0]
        sizes = getattr(modules[module], "output_sizes", None)
        expected |= {f"{name}#{i}" for i in range(len(sizes))} if sizes else {name}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
