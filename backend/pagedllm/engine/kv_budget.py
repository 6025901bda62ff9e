"""The KV cache's byte budget: `kv_cache_memory_bytes` when given; on a GPU otherwise a fraction of the device,
`gpu_memory_utilization` (vLLM's setting and default, 0.9); on CPU otherwise CPU_DEFAULT_KV_BYTES.

On a GPU the fraction covers everything this engine holds: after the weights are loaded, the KV cache gets
    total x utilization - (total - free now) - the activation reserve
where `total - free` is everything already on the device (our weights, the CUDA context, and other processes':
like vLLM, we never take memory someone else holds), and the reserve is an upper estimate of one step's peak
activations (activation_reserve_bytes). A draft model whose KV is sized from the target's (a quarter of it)
shares that fraction: the target keeps 4/5 of it. Both limits together are refused: one would be ignored.
"""

from __future__ import annotations

import torch

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 1 * GiB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# cuBLAS / Triton workspaces and allocator fragmentation on top of the estimated activations
_WORKSPACE_BYTES = 256 << 20


def kv_budget_bytes(cache_config, device: str, hf_config, dtype: torch.dtype, max_num_batched_tokens: int,
                    max_num_seqs: int, tensor_parallel_size: int = 1, shared_with_draft: bool = False) -> int:
    explicit, utilization = cache_config.kv_cache_memory_bytes, cache_config.gpu_memory_utilization
    if explicit is not None and utilization is not None:
        raise ValueError("kv_cache_memory_bytes and gpu_memory_utilization: give one of them (each sets the KV "
                         "budget; the other would be ignored)")
    if explicit is not None:
        return explicit
    if not device.startswith("cuda"):
        if utilization is not None:
            raise ValueError(f"gpu_memory_utilization: sizes the KV cache of a GPU, and this engine runs on "
                             f"{device}; give kv_cache_memory_bytes instead")
        return CPU_DEFAULT_KV_BYTES
    free, total = torch.cuda.mem_get_info(torch.device(device))
    reserve = activation_reserve_bytes(hf_config, dtype, max_num_batched_tokens, max_num_seqs, tensor_parallel_size)
    budget = budget_from_utilization(total, free, utilization or DEFAULT_GPU_MEMORY_UTILIZATION, reserve)
    return budget - budget // 5 if shared_with_draft else budget  # the draft then takes a quarter of the rest


def budget_from_utilization(total: int, free: int, utilization: float, reserve: int) -> int:
    used = total - free
    budget = int(total * utilization) - used - reserve
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of the device's {total / GiB:.1f} GiB leaves no room for the "
            f"KV cache: {used / GiB:.2f} GiB is in use already (the weights, other processes) and "
            f"{reserve / GiB:.2f} GiB is kept for activations. Raise gpu_memory_utilization, or lower "
            f"max_num_batched_tokens / max_num_seqs.")
    return budget


def activation_reserve_bytes(hf_config, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int,
                             tensor_parallel_size: int = 1) -> int:
    """An upper estimate of one step's live activations on one rank: per batched token the residual stream,
    the normed input, the fused QKV, the attention output and the MLP's gate_up plus its activation (the
    widest layer's tensors all live at once, which the real step never needs), and per sampled row fp32
    logits twice (the logits and the probabilities)."""
    elem = torch.empty((), dtype=dtype).element_size()
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    # an MoE layer's routed copies: each token reaches num_experts_per_tok experts
    intermediate = (getattr(hf_config, "moe_intermediate_size", None) or getattr(hf_config, "intermediate_size", None)
                    or 4 * hidden) * max(1, getattr(hf_config, "num_experts_per_tok", None) or 1)
    tp = tensor_parallel_size
    per_token = (3 * hidden + (heads + 2 * kv_heads) * head_dim // tp + heads * head_dim // tp
                 + 3 * intermediate // tp)
    logits = 2 * max_num_seqs * hf_config.vocab_size * 4
    return max_num_batched_tokens * per_token * elem + logits + _WORKSPACE_BYTES
