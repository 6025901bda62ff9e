"""Engine statistics: a snapshot a caller (tests, the Triton adapter, metrics) can read at any time. Each
component fills its own fields (Scheduler.stats, KVCacheManager.stats, SpecDecodeStats.fields)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int  # usable blocks (the null block excluded)
    num_blocks_free: int
    kv_cache_usage: float  # fraction of usable blocks in use
    num_preemptions: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    prompt_tokens: int  # prompt tokens computed (recomputation after preemption included)
    generation_tokens: int
    num_steps: int
    attention_backend: str
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    attention_selection: dict = field(default_factory=dict)  # chosen backend, why, and each probe's result
    spec_decode_num_drafts: int = 0  # verification runs (one request, one step)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft i
    kernels: dict[str, bool] = field(default_factory=dict)  # the CPU kernel switches (EngineConfig)
    decode_graphs: dict = field(default_factory=dict)  # CUDA-graph buckets captured ("sizes"), or why none ("reason")
    lora_max: int = 0  # LoRA slots (0: LoRA off)
    lora_running: list[str] = field(default_factory=list)  # adapters of running requests, by name
    lora_waiting: list[str] = field(default_factory=list)  # adapters of waiting requests
    lora_loads: int = 0  # adapters put in a slot (first use, or again after an eviction)
    # mixture of experts: per MoE layer, the tokens routed to each expert so far (rank 0's count)
    moe_expert_tokens: dict[int, list[int]] = field(default_factory=dict)
