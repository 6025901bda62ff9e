"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`, or `.bin`) read into
per-projection (A, B) pairs, checked against the base model before anything uses it.

Targets: the seven projections q/k/v/o and gate/up/down, and the embedding and LM head. Scaling is folded into
B: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (`use_rslora`), per module (`alpha_pattern` and
`rank_pattern` as PEFT matches them). An adapter may also carry its own full embedding or LM head (PEFT's
`modules_to_save`, or the `base_layer` copies it saves beside LoRA on those layers): requests of that adapter
use it in place of the model's. What the engine cannot run exactly is refused with a message naming it: DoRA,
LoRA biases, other `modules_to_save`, unknown target modules, a rank above `max_lora_rank`, a shape that does not
match the model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXTRA_MODULES = ("embed_tokens", "lm_head")
_PREFIX = r"^(?:base_model\.model\.)?(?:model\.)?"
_PROJ_KEY = re.compile(_PREFIX + r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_EMBED_KEY = re.compile(_PREFIX + r"embed_tokens\.lora_embedding_([AB])$")
_HEAD_KEY = re.compile(r"^(?:base_model\.model\.)?lm_head\.lora_([AB])\.weight$")
_FULL_KEY = re.compile(_PREFIX + r"(embed_tokens|lm_head)(?:\.base_layer)?\.weight$")


@dataclass
class LoRAAdapter:
    """A: [r, in], B: [out, r] with the scaling folded in (the embedding's A is [r, vocab], B [hidden, r])."""

    path: str
    rank: int  # the largest of its modules' ranks
    projections: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    embed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    lm_head: tuple[torch.Tensor, torch.Tensor] | None = None
    full: dict[str, torch.Tensor] = field(default_factory=dict)  # its own embed_tokens / lm_head [vocab, hidden]

    def num_bytes(self) -> int:
        pairs = list(self.projections.values()) + [p for p in (self.embed_tokens, self.lm_head) if p]
        full = sum(w.numel() * w.element_size() for w in self.full.values())
        return full + sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in pairs)


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """Checkpoint projection -> (in_features, out_features) of the full (unsharded) model."""
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    d = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * d, hf_config.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def load_peft_adapter(path: str, hf_config, max_rank: int) -> LoRAAdapter:
    """Read and check one adapter; ValueError naming the first problem."""
    config = _read_config(path)
    tensors = _read_tensors(path)
    shapes = projection_shapes(hf_config)
    pairs: dict[object, dict[str, torch.Tensor]] = {}
    full: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if m := _PROJ_KEY.match(key):
            layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
            if module not in shapes:
                raise ValueError(f"{path}: {key}: unknown target module {module!r} (supported: "
                                 f"{', '.join(PROJECTIONS + EXTRA_MODULES)})")
            if layer >= hf_config.num_hidden_layers:
                raise ValueError(f"{path}: {key}: layer {layer}, the model has {hf_config.num_hidden_layers}")
            pairs.setdefault((layer, module, m.group(2)), {})[ab] = tensor
        elif m := _EMBED_KEY.match(key):
            pairs.setdefault("embed_tokens", {})[m.group(1)] = tensor
        elif m := _HEAD_KEY.match(key):
            pairs.setdefault("lm_head", {})[m.group(1)] = tensor
        elif m := _FULL_KEY.match(key):
            full[m.group(1)] = tensor
        elif "lora_magnitude_vector" in key:
            raise ValueError(f"{path}: DoRA adapters (use_dora) are not supported")
        else:
            raise ValueError(f"{path}: unexpected tensor {key!r} (only LoRA A/B weights of "
                             f"{', '.join(PROJECTIONS + EXTRA_MODULES)} are supported)")
    if not pairs and not full:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    adapter = LoRAAdapter(path, 0)
    for name, weight in full.items():
        if tuple(weight.shape) != (hf_config.vocab_size, hf_config.hidden_size):
            raise ValueError(f"{path}: its {name} is {tuple(weight.shape)}, the model's is "
                             f"[{hf_config.vocab_size}, {hf_config.hidden_size}] (a resized vocabulary is not supported)")
        adapter.full[name] = weight.float()
    for where, ab in pairs.items():
        # PEFT's module names (what alpha_pattern matches against)
        name = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}.get(where) if isinstance(where, str) \
            else f"model.layers.{where[0]}.{where[2]}.{where[1]}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {name}: lora_A and lora_B must both be present")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"{path}: {name}: lora_A and lora_B must be matrices, got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
        if where == "embed_tokens":
            want_in, want_out = hf_config.vocab_size, hf_config.hidden_size
        elif where == "lm_head":
            want_in, want_out = hf_config.hidden_size, hf_config.vocab_size
        else:
            want_in, want_out = shapes[where[1]]
        r = a.shape[0]
        if a.shape[1] != want_in or b.shape != (want_out, r):
            raise ValueError(f"{path}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                             f"the model (expected [r, {want_in}] and [{want_out}, r])")
        if r > max_rank:
            raise ValueError(f"{path}: {name}: rank {r} is above max_lora_rank={max_rank}")
        b = b * _scaling(config, name, r)
        adapter.rank = max(adapter.rank, r)
        if isinstance(where, str):
            setattr(adapter, where, (a, b))
        else:
            adapter.projections[where[:2]] = (a, b)
    return adapter


def _read_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot be read: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {config.get('peft_type')!r}: only LORA adapters are supported")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)")):
        if config.get(key):
            raise ValueError(f"{file}: {why} is not supported")
    alpha = config.get("lora_alpha", 8)
    patterns = config.get("alpha_pattern") or {}
    if not _number(alpha) or not isinstance(patterns, dict) or not all(_number(v) for v in patterns.values()):
        raise ValueError(f"{file}: lora_alpha and alpha_pattern's values must be numbers")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"{file}: alpha_pattern {pattern!r} is not a regular expression: {e}") from None
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={config['bias']!r}: LoRA biases are not supported (only 'none')")
    others = [m for m in config.get("modules_to_save") or [] if m not in EXTRA_MODULES]
    if others:
        raise ValueError(f"{file}: modules_to_save {others} is not supported (only embed_tokens and lm_head)")
    targets = config.get("target_modules")  # a string is a regex (or "all-linear"): the tensors tell then
    unknown = [t for t in targets if t not in PROJECTIONS + EXTRA_MODULES] if isinstance(targets, list) else []
    if unknown:
        raise ValueError(f"{file}: unknown target module(s) {unknown} (supported: "
                         f"{', '.join(PROJECTIONS + EXTRA_MODULES)})")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, binary = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(binary):
            return torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{path}: the adapter's weights cannot be read: {type(e).__name__}: {e}") from None
    raise ValueError(f"{path}: no adapter_model.safetensors or adapter_model.bin")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's: alpha / r (alpha / sqrt(r) with rsLoRA), alpha from alpha_pattern where a pattern matches."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
