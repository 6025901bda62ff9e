"""The decoder layers' loop in C++ (decoder_loop.cpp): one call runs a step through every Llama-family layer with
the kernels beside it (the linears' bf16 or AMX tiles and oneDNN's packed matmul, or int4 / fp8 / int8 kernels,
fused norms and rotary, the KV store, paged attention), bit-identical to calling them one by one.
backend/pagedllm/models/decoder_loop.py decides where it applies."""

from __future__ import annotations

import torch

from pagedllm_kernels.cpu.build import extension


def linear(tiles: torch.Tensor, bias: torch.Tensor | None):
    """A layer's linear: its weight in bf16_tiles.py's tiles, its float32 bias or None."""
    return extension().LoopLinear.bf16_tiles(tiles, bias)


def amx_linear(packed: torch.Tensor, bias: torch.Tensor | None):
    """A layer's linear on an AMX host: its weight in amx_linear.py's tiles, its float32 bias or None."""
    return extension().LoopLinear.amx(packed, bias)


def packed_linear(onednn_weight: torch.Tensor, bias: torch.Tensor | None, tiles, tile_rows: int):
    """A PackedLinear: up to `tile_rows` rows through `tiles` (a `linear` or `amx_linear` above, or None), more
    through oneDNN's matmul on its packed weight (bias in the model's dtype, or None)."""
    return extension().LoopLinear.packed(onednn_weight, bias, tiles, int(tile_rows))


def onednn_rows(rows: int) -> int:
    """The rows the loop gives oneDNN's matmul for a step of `rows` (packed_linear.py's bucket_rows)."""
    return extension().onednn_rows(int(rows))


def int4_linear(packed, scales, mins, group_size: int, perm: torch.Tensor | None, bias: torch.Tensor | None):
    """An int4 (AWQ/GPTQ) linear in int4_layout.py's layout; `perm`: desc_act's input order, or None."""
    return extension().LoopLinear.int4(packed, scales, mins, int(group_size), perm, bias)


def fp8_linear(packed, scales, bias: torch.Tensor | None, activations: str | None, static_scale: float | None):
    """An fp8-weight linear in fp8_linear.py's layout; `activations` as Fp8Config's (None: bf16 inputs)."""
    static = float(static_scale) if activations == "static" else 0.0  # 0: the scale from the input's max
    return extension().LoopLinear.fp8(packed, scales, bias, activations is not None, static,
                                      activations == "dynamic_token")


def int8_linear(packed, scales, wsum, bias: torch.Tensor | None):
    """A W8A8 linear in int8_linear.py's layout."""
    return extension().LoopLinear.int8(packed, scales, wsum, bias)


def layer(input_norm, post_norm, qkv, o, gate_up, down, q_norm, k_norm, k_cache, v_cache, window: int,
          k_scale: float, v_scale: float):
    """One decoder layer: its norms' weights, its four `linear`s, per-head q/k norm weights (or None), its KV
    cache in kv_layout.py's layout, its sliding window (0: none) and an fp8 cache's scales."""
    return extension().LoopLayer(input_norm, post_norm, qkv, o, gate_up, down, q_norm, k_norm, k_cache, v_cache,
                                 int(window), float(k_scale), float(v_scale))


def loop(layers: list, final_norm: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
         scale: float, prefetch: bool, amx_attention: bool = False):
    """The loop over `layers`; its forward(x, cos, sin, slots, block_tables, seq_lens, query_start) returns the
    final norm's output. `amx_attention`: prompts' attention on the AMX tile unit (paged_attention's `amx`)."""
    return extension().DecoderLoop(layers, final_norm, num_heads, num_kv_heads, head_dim, float(eps), float(scale),
                                   bool(prefetch), bool(amx_attention))
