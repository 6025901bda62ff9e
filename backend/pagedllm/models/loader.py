"""Builds a registered model from its HF config and fills it from (possibly sharded) safetensors files, PyTorch
`.bin` files (older checkpoints: pytorch_model.bin or its sharded index, loaded with weights_only) or a .gguf
file (dequantized, pagedllm.models.gguf_checkpoint).

Two separate steps, so that a caller can transform the built model before its weights load (the tensor-parallel
transform makes each layer read only its rank's slice) and after (packing linears, fused ops): the caller
composes them (pagedllm.engine.executor.worker); nothing here knows about parallelism.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors import safe_open

from pagedllm.attention.kv_quant import KVScales
from pagedllm.models.checkpoint import gguf_file
from pagedllm.models.gguf_checkpoint import gguf_tensors
from pagedllm.models.gguf_metadata import tensor_directory_of
from pagedllm.models.registry import resolve_model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# An fp8-KV checkpoint's per-tensor scales of a layer's K and V, as llm-compressor and vLLM name them (and
# compressed-tensors' older output scales of k_proj / v_proj; AutoFP8's one kv_scale for both).
_KV_SCALE_SUFFIXES = {".k_scale": "k", ".v_scale": "v", ".k_proj.output_scale": "k", ".v_proj.output_scale": "v",
                      ".kv_scale": "kv"}


def checkpoint_files(model_dir: str) -> tuple[str, list[str]]:
    """("safetensors" | "bin", the files): safetensors first, as transformers prefers them."""
    for kind, single in (("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")):
        index = os.path.join(model_dir, single + ".index.json")
        if os.path.exists(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            return kind, [os.path.join(model_dir, n) for n in names]
        if os.path.exists(os.path.join(model_dir, single)):
            return kind, [os.path.join(model_dir, single)]
    raise FileNotFoundError(f"no model.safetensors, pytorch_model.bin or their .index.json in {model_dir}")


def build_model(hf_config, device: str = "cpu", model_impl: str = "auto") -> torch.nn.Module:
    """The registered architecture's model (or the transformers fallback, per `model_impl`), built on `device`
    with uninitialised weights, in eval mode."""
    with torch.device(device):
        return resolve_model_class(hf_config, model_impl)(hf_config).eval()


def load_weights(model: torch.nn.Module, model_dir: str, dtype: torch.dtype) -> None:
    """Cast `model` to dtype and fill every parameter from the checkpoint; a layer with a `load_weight` method
    reads its own part of a tensor (a lazy slice). Raises ValueError for a tensor with no place, a wrong shape,
    or a parameter the checkpoint lacks. The transformers fallback loads itself (transformers' own loading)."""
    if hasattr(model, "load_pretrained"):
        if gguf_file(model_dir) is not None:
            raise ValueError(f"{model_dir}: a .gguf file of architecture {model.config.architectures[0]!r} is not "
                             "supported (the transformers fallback reads HF checkpoints only)")
        model.load_pretrained(model_dir, dtype)
        return
    model.to(dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    splits = model.checkpoint_splits(model.config)
    loaded: set[str] = set()
    for name, ckpt in _checkpoint_tensors(model_dir, model.config):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if _load_kv_scale(modules, name, ckpt):
            continue
        target, shard = model.checkpoint_name(name)
        if target not in params and _zero_bias_to_skip(modules, target, ckpt):
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        sizes = splits.get(target.rsplit(".", 2)[-2]) if shard is None else None
        if sizes is None:
            loaded.add(_load_one(params, modules, name, target, shard, ckpt))
            continue
        shape = _shape(ckpt)
        if shape[0] != sum(sizes):
            raise ValueError(f"{name}: {shape[0]} rows, expected {sum(sizes)} ({' + '.join(map(str, sizes))})")
        at = 0
        for i, size in enumerate(sizes):  # one fused checkpoint tensor -> each shard's rows
            loaded.add(_load_one(params, modules, name, target, i, ckpt[at:at + size]))
            at += size
    _check_complete(params, modules, loaded, tied)


def _load_one(params, modules, name: str, target: str, shard: int | None, ckpt) -> str:
    """Copy one checkpoint tensor (or one shard's rows of it) into its parameter; returns what it loaded."""
    param = params[target]
    custom = getattr(modules[target.rsplit(".", 1)[0]], "load_weight", None)
    if custom is not None:
        custom(param, shard, ckpt)
    else:
        shape = _shape(ckpt)
        if tuple(param.shape) != shape:
            raise ValueError(f"{name}: shape {shape} != expected {tuple(param.shape)}")
        param.data.copy_(ckpt[:])
    return target if shard is None else f"{target}#{shard}"


def _zero_bias_to_skip(modules, target: str, ckpt) -> bool:
    """AutoGPTQ saves a bias for every projection, zeros where the model has none: those are skipped (as vLLM
    does); a nonzero one is still an error."""
    owner = modules.get(target.rsplit(".", 1)[0])
    return target.endswith(".bias") and getattr(owner, "ignores_zero_bias", False) and not ckpt[...].any()


def _load_kv_scale(modules, name: str, ckpt) -> bool:
    """A layer's K or V cache scale into its attention module's kv_scales; False if `name` is not one."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            attention = modules.get(name[: -len(suffix)].removesuffix(".self_attn") + ".self_attn")
            if attention is None or not hasattr(attention, "kv_scales"):
                raise ValueError(f"checkpoint tensor {name!r}: no attention layer takes a KV cache scale there")
            value = float(ckpt[...].float().reshape(-1)[0]) if math.prod(_shape(ckpt)) == 1 else None
            if value is None or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be one positive number, "
                                 "and finite")
            k = value if which in ("k", "kv") else attention.kv_scales.k
            v = value if which in ("v", "kv") else attention.kv_scales.v
            attention.kv_scales = KVScales(k, v)
            return True
    return False


def _shape(ckpt) -> tuple[int, ...]:
    """A checkpoint tensor's shape, whether a tensor or a lazy safetensors slice."""
    return tuple(ckpt.shape) if isinstance(ckpt, torch.Tensor) else tuple(ckpt.get_shape())


def _checkpoint_tensors(model_dir: str, hf_config):
    """(name, tensor) pairs: safetensors' are lazy slices (a sharded layer reads only its rows or columns), a
    .bin file's are memory-mapped tensors, a GGUF file's are dense tensors, dequantized one at a time."""
    path = gguf_file(model_dir)
    if path is not None:
        yield from gguf_tensors(path, hf_config, tensor_directory_of(path))
        return
    kind, files = checkpoint_files(model_dir)
    for file in files:
        if kind == "bin":  # weights_only: a pickle that holds anything but tensors is refused, never run
            yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()
            continue
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _check_complete(params, modules, loaded: set[str], tied: bool) -> None:
    expected = set()
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        module, leaf = name.rsplit(".", 1)
        shards = getattr(modules[module], "checkpoint_shards", {}).get(leaf)  # a mixture of experts' pieces
        sizes = getattr(modules[module], "output_sizes", None)
        if shards:
            expected |= {f"{name}#{s}" for s in shards}
        else:
            expected |= {f"{name}#{i}" for i in range(len(sizes))} if sizes else {name}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
