"""fp8 KV-cache scales computed at load (`calculate_kv_scales`): one prefill of a calibration text through the
model, each layer's K and V scale set from the largest magnitude its K and V reach there.

scale = amax / K_RANGE for K and amax / V_RANGE for V: vLLM's constants (its K_SCALE_CONSTANT and
V_SCALE_CONSTANT). They leave 2.2x (K) and 4.5x (V) of e4m3's ±448 as headroom for prompts that reach further
than the calibration text did. e4m3 keeps the same relative precision over its whole normal range (2^-6 to 448
units), so the headroom costs precision only for the values small enough to fall among its subnormals. With
unit scales (the default) a layer whose K or V reaches past 448 is clipped, and one whose values are all tiny
loses their precision; computed scales avoid both without a checkpoint that carries its own.

Each layer's scales are set inside the calibration step itself, from that step's K and V, before the backend
stores them: the pass attends over exactly what the cache then holds, so no layer's input is distorted by an
earlier layer's clipping. The blocks the step used are free again afterwards (nothing references them, and
no prefix hash points at them).
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.kv_quant import KVScales
from pagedllm.engine.step_inputs import StepRow, build_step_inputs

logger = logging.getLogger(__name__)

K_RANGE = 200.0
V_RANGE = 100.0
# Varied on purpose: prose, code, numbers and markup reach different activations.
CALIBRATION_TEXT = (
    "The committee met on Tuesday, 14 March 2023, to review the quarterly figures. Revenue rose 12.5% to "
    "$4,318,000 while costs fell slightly; the board asked why inventory turnover had slowed in the northern "
    "region.\n\ndef merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    i = j = 0\n    out = []\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
    "<table><tr><td>id</td><td>name</td></tr><tr><td>7</td><td>Ada Lovelace</td></tr></table>\n"
    "Q: What is the capital of Australia? A: Canberra. Q: Translate 'good morning' into French. A: Bonjour.\n"
    "In 1905 Einstein published four papers; E = mc^2 follows from the last of them. Photosynthesis turns "
    "carbon dioxide and water into glucose and oxygen, using the energy of sunlight absorbed by chlorophyll.\n"
    "SELECT name, COUNT(*) FROM orders WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY 2 DESC;\n"
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who never "
    "spoke of the years he had spent at sea."
)


class _ScaleSetter:
    """The runner's backend during the calibration step: sets each attention module's scales from its K and V
    before the real backend stores and attends with them."""

    def __init__(self, backend, module_of_cache: dict[int, torch.nn.Module]) -> None:
        self.backend = backend
        self.module_of_cache = module_of_cache
        self.calibrated: set[int] = set()  # the caches (layers) whose scales this step set

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window, softcap, kv_scales):
        key = kv_cache.data_ptr()
        amax_k, amax_v = k.float().abs().amax().item(), v.float().abs().amax().item()
        self.calibrated.add(key)
        kv_scales = KVScales(amax_k / K_RANGE if amax_k > 0 else 1.0, amax_v / V_RANGE if amax_v > 0 else 1.0)
        self.module_of_cache[key].kv_scales = kv_scales
        return self.backend.forward(q, k, v, kv_cache, meta, scale, sliding_window, softcap, kv_scales)

    def __getattr__(self, name):  # everything else is the real backend's
        return getattr(self.backend, name)


def calibrate_kv_scales(runner, model, token_ids: list[int], block_size: int) -> list[KVScales]:
    """Set every layer's fp8 KV scales from one prefill of `token_ids` on a fresh cache (blocks 1.. free)."""
    layers = model.model.layers
    attention = [layer.self_attn for layer in layers]
    if len(runner.kv_caches) != len(attention) or not all(hasattr(a, "kv_scales") for a in attention):
        raise ValueError("calculate_kv_scales: this model's attention layers do not take fp8 KV scales")
    from_checkpoint = sum(a.kv_scales != KVScales() for a in attention)
    if from_checkpoint:
        logger.warning("calculate_kv_scales: %d layers' scales from the checkpoint are replaced by computed ones",
                       from_checkpoint)
    needed = -(-len(token_ids) // block_size)
    row = StepRow(token_ids=list(token_ids), start=0, block_ids=list(range(1, needed + 1)), num_logits=1)
    step, _ = build_step_inputs([row], block_size)
    setter = _ScaleSetter(runner.backend, {cache.data_ptr(): a for cache, a in zip(runner.kv_caches, attention)})
    runner.backend = setter
    try:
        runner.execute_step(step)
    finally:
        runner.backend = setter.backend
    if len(setter.calibrated) != len(attention):
        raise RuntimeError(f"calculate_kv_scales: {len(setter.calibrated)} of {len(attention)} layers were "
                           "calibrated")
    scales = [a.kv_scales for a in attention]
    logger.info("fp8 KV scales computed from %d tokens: K %.4g..%.4g, V %.4g..%.4g", len(token_ids),
                min(s.k for s in scales), max(s.k for s in scales), min(s.v for s in scales),
                max(s.v for s in scales))
    return scales
