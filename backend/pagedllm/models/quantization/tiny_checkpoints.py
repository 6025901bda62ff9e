"""AWQ, GPTQ and FP8 checkpoints made from a dense HF directory, packed as the formats' own tools write them
(int4_formats.py; FP8 as llm-compressor and AutoFP8 do), and beside each its dequantized dense twin: what
transformers runs as the oracle.

    make_int4_checkpoint(dense_dir, out_dir, "gptq", group_size=64, desc_act=True, sym=False)
    make_fp8_checkpoint(dense_dir, out_dir, "compressed-tensors", weight_strategy="channel", activations="static")
        -> (out_dir, out_dir + "-dequantized")
    make_int8_twin(dense_dir, out_dir) -> out_dir: what quantization="int8" makes of dense_dir's weights

Every decoder projection is round-to-nearest quantized; the other tensors are stored in fp16, as published
checkpoints are, and the twin holds exactly those fp16 values (in fp32). FP8 weights are scaled by max |w| / 448
per tensor or per output row; a static activation scale is calibrated by running the dense model in
transformers over random tokens (max |x| / 448 of each projection's input). desc_act gives the input rows groups
in a random order, as GPTQ's activation ordering does, through g_idx: one order per input, so q/k/v (and
gate/up), which read the same input and so the same Hessian in GPTQ, share theirs. GPTQ checkpoints also get
a zero `bias` for every projection that has none, as AutoGPTQ writes them.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from pagedllm.models.quantization.int4_formats import group_index, pack_awq, pack_gptq, quantize_rtn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _act_order(in_features: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ desc_act's g_idx: the rows, taken in a random order, fill group after group."""
    order = torch.randperm(in_features, generator=gen)
    g_idx = torch.empty(in_features, dtype=torch.long)
    g_idx[order] = torch.arange(in_features) // group_size
    return g_idx


def make_int4_checkpoint(dense_dir: str, out_dir: str, method: str, group_size: int = 128,
                         desc_act: bool = False, sym: bool = True, seed: int = 0) -> tuple[str, str]:
    if method not in ("awq", "gptq") or (method == "awq" and (desc_act or sym)):
        raise ValueError("method: 'awq' (asymmetric, no desc_act) or 'gptq'")
    gen = torch.Generator().manual_seed(seed)
    orders: dict = {}

    def quantize(prefix: str, weight: torch.Tensor, has_bias: bool):
        k = weight.shape[1]
        gs = k if group_size == -1 else group_size
        layer, proj = prefix.rsplit(".", 1)
        input_key = (layer.rsplit(".", 1)[0], SHARED_INPUT.get(proj, proj))
        if input_key not in orders:
            orders[input_key] = _act_order(k, gs, gen) if desc_act else group_index(k, group_size)
        w = quantize_rtn(weight, orders[input_key], sym, zero_range=(1, 15) if method == "gptq" else (0, 15))
        packed = pack_gptq(w) if method == "gptq" else pack_awq(w)
        if method == "gptq" and not has_bias:
            packed["bias"] = torch.zeros(weight.shape[0], dtype=torch.float16)
        return packed, w.dequantize()

    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"} \
        if method == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
                                 "sym": sym, "checkpoint_format": "gptq"}
    return _write(dense_dir, out_dir, quantize, qc)


def make_fp8_checkpoint(dense_dir: str, out_dir: str, method: str = "compressed-tensors",
                        weight_strategy: str = "tensor", activations: str | None = None) -> tuple[str, str]:
    """method "fp8" (per-tensor weights; activations "dynamic" or "static") or "compressed-tensors" (weights per
    "tensor" or "channel"; activations None, "dynamic", "dynamic_token" or "static")."""
    input_amax = _calibrate(dense_dir) if activations == "static" else {}

    def quantize(prefix: str, weight: torch.Tensor, has_bias: bool):
        w = weight.float()
        amax = w.abs().amax(dim=1, keepdim=True) if weight_strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / 448).clamp_min(1e-12)
        w8 = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors = {"weight": w8, "weight_scale": scale.float()}
        if activations == "static":
            tensors["input_scale"] = (input_amax[prefix] / 448).reshape(1).float()
        return tensors, w8.float() * scale

    if method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": activations or "dynamic"}
    else:
        a = None if activations is None else {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": activations != "static",
            "strategy": "token" if activations == "dynamic_token" else "tensor"}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": a, "weights": {
                  "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": weight_strategy}}}}
    return _write(dense_dir, out_dir, quantize, qc)


def make_int8_twin(dense_dir: str, out_dir: str) -> str:
    """dense_dir with each decoder projection's weight as quantization="int8" holds it, dequantized: round(w / s)
    * s with s = max |w| / 127 per output row (the kernel's own quantize_rows; per row, so fusing q/k/v or
    gate/up at load changes nothing). The rest as it is: int8 quantizes a dense checkpoint, not fp16's."""
    from pagedllm_kernels.cpu.int8_linear import quantize_rows

    shutil.copytree(dense_dir, out_dir, dirs_exist_ok=True)
    tensors = load_file(os.path.join(dense_dir, "model.safetensors"))
    for name, w in tensors.items():
        if _is_projection(name):
            q, scales = quantize_rows(w)
            tensors[name] = q.float() * scales[:, None]  # fp32: exactly these
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _is_projection(name: str) -> bool:
    """A decoder projection's weight (`model.layers.N.self_attn.q_proj.weight`, ...)."""
    return ".layers." in name and name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] \
        in PROJECTIONS


def _calibrate(dense_dir: str) -> dict[str, torch.Tensor]:
    """max |x| of each projection's input over random tokens, run through transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    amax: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: amax.__setitem__(
        name, torch.maximum(amax.get(name, torch.tensor(0.0)), args[0].abs().max())))
             for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(torch.randint(3, model.config.vocab_size, (4, 64), generator=gen))
    for h in hooks:
        h.remove()
    return amax


def _write(dense_dir: str, out_dir: str, quantize, qc: dict) -> tuple[str, str]:
    """Every decoder projection through `quantize(prefix, weight, has_bias) -> (its tensors, dense weight)`,
    the rest in fp16; the quantized directory and its dequantized twin."""
    twin = out_dir + "-dequantized"
    for d in (out_dir, twin):
        shutil.copytree(dense_dir, d, dirs_exist_ok=True)
    quantized, dense = {}, {}
    tensors = load_file(os.path.join(dense_dir, "model.safetensors"))
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if not _is_projection(name):
            quantized[name] = tensor.half()
            dense[name] = tensor.half().float()
            continue
        packed, dense[name] = quantize(prefix, tensor, f"{prefix}.bias" in tensors)
        quantized |= {f"{prefix}.{part}": t for part, t in packed.items()}
    save_file(quantized, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense_dir, "config.json")) as f:
        config = json.load(f)
    for d, extra in ((out_dir, {"quantization_config": qc, "torch_dtype": "float16"}),
                     (twin, {"torch_dtype": "float32"})):
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**{k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}, **extra}, f,
                      indent=2)
    return out_dir, twin
