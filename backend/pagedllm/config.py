"""Engine configuration: frozen dataclasses validated at construction.

`EngineConfig.from_kwargs` is the single place where user-facing keyword arguments (offline `LLM(...)`,
Triton's engine.json, the CLI) become a validated configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GiB = 1 << 30


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for K and V of all layers. The number of blocks is derived from it (see kv_cache_manager).
    kv_cache_memory_bytes: int = 1 * GiB
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", f"must be a positive power of two, got {self.block_size}")
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    max_queue_size: int | None = None  # waiting requests beyond this are rejected ("overloaded")

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        _require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
                 f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        _require(self.max_queue_size is None or self.max_queue_size > 0, "max_queue_size", "must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    attention_backend: str = "auto"
    device: str = "auto"  # "auto" (cuda when available) | "cpu" | "cuda" | "cuda:N"
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3} or
    # {"method": "draft_model", "model": DIR, "num_speculative_tokens": k, "kv_cache_memory_bytes": n}
    speculative_config: dict | None = None
    # Ranks the model is split over (1: no parallelism). cache.kv_cache_memory_bytes is per rank (as vLLM's
    # memory settings are per GPU): each rank holds its share of the KV heads of every block.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # only 1: see docs/ARCHITECTURE.md, "Pipeline parallelism"
    log_stats: bool = False  # the periodic one-line engine log
    log_stats_interval_s: float = 5.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be > 0")
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        _require(self.pipeline_parallel_size == 1, "pipeline_parallel_size",
                 f"only 1 is supported (got {self.pipeline_parallel_size!r}); split the model with "
                 "tensor_parallel_size instead")
        spec = self.speculative_config
        if spec is not None:
            _require(isinstance(spec, dict) and spec.get("method") in ("ngram", "draft_model"),
                     "speculative_config", f"method must be 'ngram' or 'draft_model', got {spec!r}")
            _require(spec.get("method") != "draft_model" or bool(spec.get("model")), "speculative_config",
                     "the draft_model method needs 'model' (the draft's directory)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Sort flat keyword arguments into the nested configs; unknown names are an error."""
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig}
        nested: dict[str, dict] = {name: {} for name in groups}
        top: dict = {}
        top_names = {f.name for f in dataclasses.fields(cls)} - set(groups)
        for key, value in kwargs.items():
            for group, klass in groups.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    nested[group][key] = value
                    break
            else:
                if key not in top_names:
                    raise ValueError(f"unknown engine argument {key!r}")
                top[key] = value
        return cls(model=model, cache=CacheConfig(**nested["cache"]),
                   scheduler=SchedulerConfig(**nested["scheduler"]), **top)
