"""A checkpoint's `quantization_config` (config.json) read into what the loader needs, or refused by name.

Supported:
- weight-only int4 in AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`) and in GPTQ's format
  (`quant_method: gptq`, `checkpoint_format: gptq`, desc_act true or false, symmetric or not), group sizes
  multiples of 32 (or -1: one group per row);
- FP8 (e4m3) weights with per-tensor or per-channel scales, `quant_method: fp8` (per tensor; activations
  `dynamic` or `static`) or compressed-tensors' float-quantized scheme (weights `strategy` tensor or channel;
  input activations none, dynamic per tensor or token, or static per tensor).
Anything else is a clear error, never a silent dense load: other bit widths and packings (GPTQ v2, Marlin,
AWQ GEMV, compressed-tensors' int schemes), block-wise FP8 scales.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Int4Config:
    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group over all input features
    desc_act: bool = False  # GPTQ's activation order: groups given per input row by g_idx
    sym: bool = True  # GPTQ symmetric: every zero point is 8
    modules_to_not_convert: tuple[str, ...] = ()

    def quantizes(self, module_name: str) -> bool:
        return not any(skip in module_name for skip in self.modules_to_not_convert)


@dataclass(frozen=True)
class Fp8Config:
    """FP8 weights; `activations`: None (weight-only), "dynamic" (per tensor), "dynamic_token", or "static"
    (the checkpoint's input_scale): x is rounded to e4m3 at that scale before the matmul, as the format says."""

    method: str  # "fp8" | "compressed-tensors"
    weight_strategy: str  # "tensor" | "channel"
    activations: str | None
    modules_to_not_convert: tuple[str, ...] = ()

    def quantizes(self, module_name: str) -> bool:
        """compressed-tensors' `ignore` entries are names or `re:` patterns."""
        for skip in self.modules_to_not_convert:
            if skip.startswith("re:"):
                if re.match(skip[3:], module_name):
                    return False
            elif module_name == skip or module_name.endswith("." + skip) or skip in module_name:
                return False
        return True


def read_quantization_config(hf_config) -> Int4Config | Fp8Config | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method not in ("awq", "gptq"):
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported (supported: awq, gptq, "
                         "fp8, compressed-tensors)")
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config: {bits}-bit {method} is not supported (4-bit only)")
    group = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise ValueError(f"quantization_config: group_size {group!r} must be -1 or a positive multiple of 32")
    skip = tuple(q.get("modules_to_not_convert") or ())
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config: AWQ version {version!r} is not supported (gemm only)")
        if not q.get("zero_point", True):
            raise ValueError("quantization_config: AWQ without zero points is not supported")
        return Int4Config("awq", group, sym=False, modules_to_not_convert=skip)
    fmt = q.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        raise ValueError(f"quantization_config: GPTQ checkpoint_format {fmt!r} is not supported (gptq only)")
    return Int4Config("gptq", group, desc_act=bool(q.get("desc_act", False)), sym=bool(q.get("sym", True)),
                      modules_to_not_convert=skip)


def _fp8(q: dict) -> Fp8Config:
    if q.get("weight_block_size"):
        raise ValueError("quantization_config: block-wise FP8 scales (weight_block_size) are not supported")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config: activation_scheme {scheme!r} must be dynamic or static")
    return Fp8Config("fp8", "tensor", scheme, tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ()))


def _compressed_tensors(q: dict) -> Fp8Config:
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"quantization_config: compressed-tensors with {len(groups)} config groups is not supported "
                         "(one group of FP8 weights)")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel") \
            or w.get("dynamic"):
        raise ValueError(f"quantization_config: compressed-tensors weights {w} are not supported (FP8, static, "
                         "strategy tensor or channel)")
    activations = None
    if a:
        if a.get("type") != "float" or a.get("num_bits") != 8 or a.get("symmetric") is False:
            raise ValueError(f"quantization_config: compressed-tensors input activations {a} are not supported")
        strategy = a.get("strategy", "tensor")
        if a.get("dynamic"):
            if strategy not in ("tensor", "token"):
                raise ValueError(f"quantization_config: dynamic activation strategy {strategy!r} is not supported")
            activations = "dynamic" if strategy == "tensor" else "dynamic_token"
        elif strategy == "tensor":
            activations = "static"
        else:
            raise ValueError(f"quantization_config: static activation strategy {strategy!r} is not supported")
    return Fp8Config("compressed-tensors", w["strategy"], activations, tuple(q.get("ignore") or ()))
