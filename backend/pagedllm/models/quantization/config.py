"""A checkpoint's `quantization_config` (config.json) read into what the loader needs, or refused by name.

Supported: weight-only int4 in AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`) and in GPTQ's
format (`quant_method: gptq`, `checkpoint_format: gptq`, desc_act true or false, symmetric or not), group
sizes dividing the input features (or -1: one group per row). Anything else is a clear error, never a silent
dense load: FP8 and compressed-tensors checkpoints, other bit widths, GPTQ v2 / Marlin packings, AWQ GEMV.
"""

from __future__ import annotations

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


def read_quantization_config(hf_config) -> Int4Config | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method not in ("awq", "gptq"):
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported (supported: awq, gptq)")
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config: {bits}-bit {method} is not supported (4-bit only)")
    group = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 16)):
        raise ValueError(f"quantization_config: group_size {group!r} must be -1 or a positive multiple of 16")
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
