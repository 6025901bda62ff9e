"""AWQ and GPTQ checkpoints made from a dense HF directory, packed as the formats' own tools write them
(int4_formats.py), and beside each its dequantized dense twin: what transformers runs as the oracle.

    make_int4_checkpoint(dense_dir, out_dir, "gptq", group_size=64, desc_act=True, sym=False)
        -> (out_dir, out_dir + "-dequantized")

Every decoder projection is round-to-nearest quantized; the other tensors are stored in fp16, as published
checkpoints are, and the twin holds exactly those fp16 values (in fp32). desc_act gives the input rows groups
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
    twin = out_dir + "-dequantized"
    for d in (out_dir, twin):
        shutil.copytree(dense_dir, d, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    quantized, dense, orders = {}, {}, {}
    tensors = load_file(os.path.join(dense_dir, "model.safetensors"))
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if ".layers." not in name or not name.endswith(".weight") or prefix.rsplit(".", 1)[-1] not in PROJECTIONS:
            quantized[name] = tensor.half()
            dense[name] = tensor.half().float()
            continue
        k = tensor.shape[1]
        gs = k if group_size == -1 else group_size
        layer, proj = prefix.rsplit(".", 1)
        input_key = (layer.rsplit(".", 1)[0], SHARED_INPUT.get(proj, proj))
        if input_key not in orders:
            orders[input_key] = _act_order(k, gs, gen) if desc_act else group_index(k, group_size)
        g_idx = orders[input_key]
        w = quantize_rtn(tensor, g_idx, sym, zero_range=(1, 15) if method == "gptq" else (0, 15))
        dense[name] = w.dequantize()
        packed = pack_gptq(w) if method == "gptq" else pack_awq(w)
        quantized |= {f"{prefix}.{part}": t for part, t in packed.items()}
        if method == "gptq" and f"{prefix}.bias" not in tensors:
            quantized[f"{prefix}.bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)
    save_file(quantized, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense_dir, "config.json")) as f:
        config = json.load(f)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"} \
        if method == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
                                 "sym": sym, "checkpoint_format": "gptq"}
    for d, extra in ((out_dir, {"quantization_config": qc, "torch_dtype": "float16"}),
                     (twin, {"torch_dtype": "float32"})):
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**{k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}, **extra}, f,
                      indent=2)
    return out_dir, twin
