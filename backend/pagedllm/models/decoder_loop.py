"""The decoder's layers in one C++ call (pagedllm_kernels/cpu/decoder_loop.cpp) for the steps its kernels take on CPU.

A bf16 decode step of the Llama family is a few hundred short kernel calls (per layer: two norms, four linears,
two rotaries, the KV store, attention, SiLU-and-mul) and what surrounds them: the modules' Python (module calls,
the launchers' checks, views) and each call's crossing into the extension. A 24-layer model too small for its
kernels to count (hidden 128) decoded at 2.2-2.7 ms a step through the modules and 1.0 ms through the loop, on the
2-core Zen 5 host (perf/README.md, session 23). The loop calls the same kernels in the same order with the same
arguments, so its output is bit-identical to the modules'; it holds the weights and the KV caches, built once
per runner.

`attach_decoder_loop` gives it to a model where every layer is made of parts it runs: the plain DecoderLayer
(Attention, MLP with SiLU, RMSNorm, optional per-head q/k norms), linears whose CPU kernels it calls as their
modules do (PackedLinear's bf16 or AMX tiles up to their raced rows and oneDNN's packed matmul above, Int4Linear's
AWQ/GPTQ kernel, Fp8Linear's widening kernel with its activations' rounding, Int8Linear's W8A8 one), the fused
ops, the CPU attention backend, rope over whole heads whose frequencies do not depend on the sequence's length,
no LoRA. Anything else (experts, Gemma's norms, soft-capping, tensor parallelism, the torch backend) keeps the
modules, and so does a step with more rows than int4's kernel takes (64: above, its module dequantizes for
oneDNN). Prompt steps go through the loop too: a 256-token prompt of the 125M model spent a third of the
OpenMP worker's time waiting for the next kernel while the modules' Python ran; through the loop it takes 0.89x
the modules' time (perf/prefill.py, session 30).
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.layers.fp8_linear import Fp8Linear
from pagedllm.models.layers.int4_linear import CPU_KERNEL_ROWS, Int4Linear
from pagedllm.models.layers.int8_linear import Int8Linear
from pagedllm.models.layers.norm import RMSNorm
from pagedllm.models.layers.packed_linear import PackedLinear
from pagedllm.models.llama import MLP, Attention, DecoderLayer, DecoderModel
from pagedllm_kernels.cpu import amx_linear
from pagedllm_kernels.cpu.build import kernel_module

logger = logging.getLogger(__name__)

UNLIMITED = 1 << 30  # the row limit of a linear whose kernel takes any batch


class DecoderLoop:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend, ops) -> None:
        decoder = model.model
        attn = decoder.layers[0].self_attn
        linears = [linear for layer in decoder.layers for linear in _linears(layer)]
        tiles = [linear for linear in linears if type(linear) is PackedLinear]  # one race setting (`unsupported`)
        self.kv_caches, self.backend = kv_caches, backend
        self.max_rows = min(_max_rows(linear) for linear in linears)
        self._loop = ops.loop(
            [_layer(ops, layer, cache) for layer, cache in zip(decoder.layers, kv_caches)], decoder.norm.weight,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, decoder.norm.eps, attn.scale,
            tiles[0].prefetch if tiles else False, backend.amx)

    def takes(self, rows: int, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool:
        """Whether this step runs through the loop: few enough rows for its linears' kernels, on the caches and
        backend it was built for (a draft model's runner has its own)."""
        return (rows <= self.max_rows and kv_caches is self.kv_caches and meta.backend is self.backend
                and meta.rope_lengths is None)

    @property
    def attention_seconds(self) -> float:
        """Time spent so far inside the loop's KV stores and attention kernels (perf/attention_share.py)."""
        return self._loop.attention_seconds

    @property
    def linear_seconds(self) -> float:
        """Time spent so far inside the layers' linears (perf/attention_share.py)."""
        return self._loop.linear_seconds

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        cos, sin = (r.reshape(x.shape[0], -1) for r in rope)
        return self._loop.forward(x, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                  self.backend.query_starts(meta))


def _linears(layer) -> list:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _max_rows(linear) -> int:
    """The most rows the kernels the loop calls for `linear` take, as its module's CPU path decides."""
    return CPU_KERNEL_ROWS if type(linear) is Int4Linear else UNLIMITED  # bf16: tiles, then oneDNN; fp8, int8: one


def _loop_linear(ops, linear):
    """`linear` as the loop's linear: the kernel its module's forward calls on a bf16 CPU input."""
    if type(linear) is PackedLinear:
        tiles = None
        if linear.tiles_kernel is not None:
            make = ops.amx_linear if linear.tiles_kernel is amx_linear else ops.linear
            tiles = make(linear.weight_tiles, linear.bias_f32)
        return ops.packed_linear(linear.packed_weight, linear.bias, tiles, linear.max_tile_rows)
    if type(linear) is Int4Linear:
        return ops.int4_linear(linear.packed, linear.scales, linear.mins, linear.group_size, linear.perm, linear.bias)
    if type(linear) is Fp8Linear:
        return ops.fp8_linear(linear.packed, linear.scales, linear.bias, linear.config.activations,
                              linear.input_scale_value)
    return ops.int8_linear(linear.packed, linear.scales, linear.wsum, linear.bias)


def _why_not_loop_linear(linear) -> str | None:
    """Why the loop cannot call `linear`'s kernel as its module would, or None."""
    if type(linear) is PackedLinear:
        return None if linear.tiles_kernel is not None else "bf16 linears without our tiles (oneDNN alone, fp32)"
    if type(linear) is Int4Linear:
        return None if kernel_module("int4_linear") is not None else "int4 linears without our CPU kernel"
    if type(linear) is Fp8Linear:
        if linear.tensor_cores or kernel_module("fp8_linear") is None:
            return "fp8 linears off our CPU kernel"
        if linear.config.activations is not None and linear.in_features % 32:
            return "fp8 activations rounded in torch (inputs not a multiple of 32)"
        return None
    if type(linear) is Int8Linear:
        return None
    return f"{type(linear).__name__} linears (sharded, LoRA or others)"


def _layer(ops, layer, cache: torch.Tensor):
    attn = layer.self_attn
    qkv, o, gate_up, down = (_loop_linear(ops, linear) for linear in _linears(layer))
    return ops.layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, qkv, o, gate_up, down,
                     attn.q_norm.weight if attn.q_norm is not None else None,
                     attn.k_norm.weight if attn.k_norm is not None else None,
                     cache[0], cache[1], attn.sliding_window or 0, attn.kv_scales.k, attn.kv_scales.v)


def unsupported(model, backend) -> str | None:
    """Why the loop cannot run `model` with `backend`, or None when it can."""
    decoder = getattr(model, "model", None)
    if type(decoder) is not DecoderModel:
        return f"{type(model).__name__}'s decoder is not the Llama family's"
    if getattr(model, "lora", None) is not None:
        return "LoRA adapters"
    if getattr(backend, "name", None) != "cpu":
        return f"the {getattr(backend, 'name', backend)!r} attention backend (the loop calls the cpu one's kernels)"
    if decoder.rotary.length_dependent:
        return "a rope whose frequencies depend on the sequence's length"
    if decoder.embed_tokens.weight.dtype != torch.bfloat16 or decoder.embed_tokens.weight.device.type != "cpu":
        return "a model not bf16 on CPU"
    first = decoder.layers[0].self_attn
    if first.head_dim % 32 or 2 * decoder.rotary.cos.shape[-1] != first.head_dim:
        return "rotary over part of a head, or a head_dim the fused rotary does not take"
    norms, tiles = [decoder.norm], []
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer), type(attn), type(mlp)) != (DecoderLayer, Attention, MLP) or mlp.act != "silu":
            return "a layer other than Attention + a SiLU MLP"
        if attn.softcap is not None or attn.fused_ops is None or mlp.fused_ops is None:
            return "soft-capped attention, or without the fused CPU ops"
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale) != (
                first.num_heads, first.num_kv_heads, first.head_dim, first.scale):
            return "layers of different attention shapes"
        for linear in _linears(layer):
            why = _why_not_loop_linear(linear)
            if why is not None:
                return why
        tiles.extend(linear for linear in _linears(layer) if type(linear) is PackedLinear)
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    if any(type(n) is not RMSNorm or n.fused_ops is None or n.eps != decoder.norm.eps for n in norms):
        return "norms other than RMSNorm with the fused ops and one epsilon"
    if any((t.max_tile_rows, t.prefetch) != (tiles[0].max_tile_rows, tiles[0].prefetch) for t in tiles):
        return "linears raced to different settings"
    return None


def attach_decoder_loop(model, kv_caches: list[torch.Tensor], backend, ops) -> bool:
    """Give `model`'s decoder a DecoderLoop over `kv_caches` where it can run (see `unsupported`; `ops`:
    pagedllm_kernels.cpu.decoder_loop, None where the C++ kernels are not here); returns whether it did."""
    if type(getattr(model, "model", None)) is DecoderModel:
        model.model.decoder_loop = None  # a loop over an earlier runner's caches must not keep them alive
    why = "no C++ CPU kernels" if ops is None else unsupported(model, backend)
    if why is not None:
        logger.info("decoder layers: one Python call per kernel (not the C++ loop: %s)", why)
        return False
    model.model.decoder_loop = DecoderLoop(model, kv_caches, backend, ops)
    rows = model.model.decoder_loop.max_rows
    logger.info("decoder layers: one C++ call a step, %s", f"up to {rows} rows" if rows < UNLIMITED else "any size")
    return True
