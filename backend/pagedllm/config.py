"""Engine configuration: frozen dataclasses validated at construction.

`EngineConfig.from_kwargs` is the single place where user-facing keyword arguments (offline `LLM(...)`,
Triton's engine.json, the CLI) become a validated configuration. Every switch of the engine is a field here;
an environment variable may set a field's default (PAGEDLLM_FUSED_CPU_OPS, PAGEDLLM_AMX_LINEAR,
PAGEDLLM_CPU_DECODER_LOOP), nothing more.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar")  # grammar engines (engine.structured_output)


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _env_default(name: str) -> bool:
    """A boolean switch's default: on unless the environment variable says 0."""
    return os.environ.get(name, "1") != "0"


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for K and V of all layers, from which the number of blocks is derived. Unset: on a GPU a fraction
    # of the device (gpu_memory_utilization, default 0.9), on CPU 1 GiB (engine/kv_budget.py). The engine's
    # config holds the resolved figure once it has started.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # "auto": the model's dtype. "fp8" (= "fp8_e4m3"): e4m3 elements with a per-tensor scale per layer's K and V
    # (the checkpoint's k_scale / v_scale, else 1.0), half the bytes of bf16 per token.
    kv_cache_dtype: str = "auto"
    # With the fp8 cache: each layer's K and V scale computed at load from one prefill of a calibration text
    # (engine/kv_calibration.py), replacing the checkpoint's or 1.0.
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                 + (" (e5m2 is not implemented: use fp8, which is e4m3)" if self.kv_cache_dtype == "fp8_e5m2" else ""))
        _require(isinstance(self.calculate_kv_scales, bool), "calculate_kv_scales", "must be true or false")
        _require(not self.calculate_kv_scales or self.kv_cache_dtype != "auto", "calculate_kv_scales",
                 "scales only an fp8 cache: set kv_cache_dtype='fp8' too")
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", f"must be a positive power of two, got {self.block_size}")
        _require(self.kv_cache_memory_bytes is None or (_int(self.kv_cache_memory_bytes)
                                                        and self.kv_cache_memory_bytes > 0),
                 "kv_cache_memory_bytes", f"must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        u = self.gpu_memory_utilization
        _require(u is None or (isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1),
                 "gpu_memory_utilization", f"must be a fraction in (0, 1], got {u!r}")


CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    max_queue_size: int | None = None  # new requests beyond this many waiting (never admitted) are rejected
    # How admission spends the KV pool (TensorRT-LLM's capacity scheduler policies):
    # "max_utilization": a request is admitted while its next chunk fits; when running requests outgrow the
    #   pool, some are preempted and later recomputed (vLLM's way, the default).
    # "guaranteed_no_evict": a new request is admitted only while the pool can also hold every admitted
    #   request's whole sequence (prompt plus max_tokens), so none is preempted because others grew: fewer run
    #   at once, none recomputes for that (the same throughput where measured, perf/README.md session 39).
    #   Priority preemption, beams and LongRoPE's recompute still preempt (engine/scheduler.py).
    capacity_scheduler_policy: str = "max_utilization"
    # A streamed request's outputs come every `stream_interval` tokens (its first and its last at once), not at
    # each one: fewer, larger responses cost the host less per token (vLLM's --stream-interval; a request may
    # ask for a longer interval, never a shorter one).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        _require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
                 f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        _require(self.max_queue_size is None or self.max_queue_size > 0, "max_queue_size", "must be > 0")
        _require(self.capacity_scheduler_policy in CAPACITY_POLICIES, "capacity_scheduler_policy",
                 f"must be one of {CAPACITY_POLICIES}, got {self.capacity_scheduler_policy!r}")
        _require(_int(self.stream_interval) and self.stream_interval >= 1, "stream_interval",
                 f"must be an integer >= 1, got {self.stream_interval!r}")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for: bounds a server needs so that no request costs the others much. Offline
    and served requests alike are checked (engine/input_processor.py); the JSON bounds apply to the Triton
    inputs that carry JSON (serving/request_parser.py)."""

    max_prompt_tokens: int | None = None  # None: max_model_len - 1 (one token of room to generate)
    max_prompt_bytes: int = 1 << 20  # a text prompt's UTF-8 bytes, checked before tokenizing
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_logprobs: int = 20  # top logprobs per generated token
    max_json_bytes: int = 64 << 10
    max_json_depth: int = 32  # nesting of arrays and objects

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "max_prompt_tokens" and value is None:
                continue
            _require(_int(value) and value >= (0 if f.name == "max_logprobs" else 1), f.name,
                     f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving. `lora_modules` declares adapters by name: {name: path} (ids 1, 2, ... in order),
    or a list of {"name", "path", "id"?} objects or "name=path" strings (vLLM's --lora-modules); normalised to
    ((name, path, id), ...). Undeclared adapters can still come with a request (offline LoRARequest)."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters resident at once (distinct adapters one step can run); others evicted LRU
    max_lora_rank: int = 16  # adapters of a higher rank are refused at load
    # adapters' weights kept in host memory for later requests, LRU (None: every one used); an adapter that a
    # queued or running request holds stays in memory regardless
    max_cpu_loras: int | None = None
    lora_modules: tuple = ()

    def __post_init__(self) -> None:
        _require(isinstance(self.enable_lora, bool), "enable_lora", "must be true or false")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            _require(_int(value) and 1 <= value <= 1024, name, f"must be an integer in [1, 1024], got {value!r}")
        _require(self.max_cpu_loras is None or (_int(self.max_cpu_loras) and self.max_cpu_loras >= self.max_loras),
                 "max_cpu_loras", f"must be an integer >= max_loras, got {self.max_cpu_loras!r}")
        modules = _lora_modules(self.lora_modules)
        _require(not modules or self.enable_lora, "lora_modules", "declared adapters need enable_lora: true")
        for name, default in (("max_loras", 1), ("max_lora_rank", 16), ("max_cpu_loras", None)):
            _require(self.enable_lora or getattr(self, name) == default, name, "has no effect without enable_lora: "
                     "true (set it too, or leave this out)")
        object.__setattr__(self, "lora_modules", modules)


def _lora_modules(spec) -> tuple:
    """lora_modules in any of its accepted forms -> ((name, path, id), ...), names and ids unique."""
    if isinstance(spec, dict):
        spec = [{"name": k, "path": v} for k, v in spec.items()]
    _require(isinstance(spec, (list, tuple)), "lora_modules", f"expected an object or a list, got {spec!r}")
    out, next_id = [], 1
    for entry in spec:
        if isinstance(entry, str) and "=" in entry:
            name, path = entry.split("=", 1)
            entry = {"name": name, "path": path}
        elif isinstance(entry, (list, tuple)) and len(entry) == 3:
            entry = dict(zip(("name", "path", "id"), entry))
        _require(isinstance(entry, dict) and set(entry) <= {"name", "path", "id"} and "name" in entry
                 and "path" in entry, "lora_modules", f"each adapter needs a name and a path, got {entry!r}")
        name, path, lid = entry["name"], entry["path"], entry.get("id", next_id)
        _require(isinstance(name, str) and name and isinstance(path, str) and path, "lora_modules",
                 f"name and path must be non-empty strings, got {entry!r}")
        _require(_int(lid) and lid >= 1, "lora_modules", f"{name}: id must be an integer >= 1, got {lid!r}")
        out.append((name, path, lid))
        next_id = max(next_id, lid) + 1
    names, ids = [m[0] for m in out], [m[2] for m in out]
    _require(len(set(names)) == len(names), "lora_modules", f"adapter names repeat: {names}")
    _require(len(set(ids)) == len(ids), "lora_modules", f"adapter ids repeat: {ids}")
    return tuple(out)


@dataclass(frozen=True)
class FaultInjection:
    """Test-only: make one point of the engine raise, to prove that a failure costs only what it should.
    `point`: "sample", "detokenize", "propose" (failures that belong to one request: they fire for requests
    whose prompt holds `token_id`) or "forward" (the shared forward pass: fires for a step whose batch holds
    such a request)."""

    point: str
    token_id: int

    def __post_init__(self) -> None:
        _require(self.point in ("sample", "detokenize", "propose", "forward"), "fault_injection",
                 f"point must be sample, detokenize, propose or forward, got {self.point!r}")
        _require(_int(self.token_id) and self.token_id >= 0, "fault_injection", "token_id must be an id >= 0")


UNIX_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes, the last a NUL


@dataclass(frozen=True)
class ServingConfig:
    """The Triton adapter's own settings (engine.json keys beside the engine's)."""

    enable_metrics: bool = True
    # A dead engine (a failed forward pass, a lost tensor-parallel worker) is rebuilt this many times in a row
    # at most, waiting engine_restart_backoff_s, then twice that, and so on, before each attempt.
    max_engine_restarts: int = 3
    engine_restart_backoff_s: float = 1.0
    # "in_process": the engine is rebuilt inside the model's process (any model-control mode; readiness stays
    # READY meanwhile). "reload": the model unloads itself (NOT READY) and loads itself again; needs Triton's
    # explicit model control (`pagedllm serve` runs that and sets this).
    engine_restart: str = "in_process"
    # A Unix socket path (at most UNIX_SOCKET_PATH_MAX bytes): the engine channel `pagedllm openai
    # --engine-channel` reaches the model through (serving/engine_channel.py); None: none (the front end goes
    # through Triton's HTTP endpoint).
    openai_channel: str | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.enable_metrics, bool), "enable_metrics", "must be true or false")
        _require(_int(self.max_engine_restarts) and self.max_engine_restarts >= 0, "max_engine_restarts",
                 f"must be an integer >= 0, got {self.max_engine_restarts!r}")
        _require(self.engine_restart in ("in_process", "reload"), "engine_restart",
                 f"must be 'in_process' or 'reload', got {self.engine_restart!r}")
        _require(isinstance(self.engine_restart_backoff_s, (int, float)) and
                 0 <= self.engine_restart_backoff_s <= 3600, "engine_restart_backoff_s",
                 f"must be seconds in [0, 3600], got {self.engine_restart_backoff_s!r}")
        _require(self.openai_channel is None or (isinstance(self.openai_channel, str) and
                                                 0 < len(self.openai_channel.encode()) <= UNIX_SOCKET_PATH_MAX),
                 "openai_channel",
                 f"must be a Unix socket path of at most {UNIX_SOCKET_PATH_MAX} bytes, "
                 f"got {self.openai_channel!r}")

    @classmethod
    def split(cls, args: dict) -> tuple[ServingConfig, dict]:
        """engine.json's entries -> (this config, the rest: the engine's arguments)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in names}), {k: v for k, v in args.items() if k not in names}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` "ngram" (prompt lookup) or "draft_model" (a smaller model sharing the
    tokenizer, at `model`)."""

    method: str
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1  # ngram: shortest and longest n-gram matched
    prompt_lookup_max: int = 3
    model: str | None = None  # draft_model: its directory
    kv_cache_memory_bytes: int | None = None  # draft_model: its KV budget (default: a quarter of the target's)

    def __post_init__(self) -> None:
        name = "speculative_config"
        _require(self.method in ("ngram", "draft_model"), name,
                 f"method must be 'ngram' or 'draft_model', got {self.method!r}")
        _require(_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 1, name,
                 f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        _require(_int(self.prompt_lookup_min) and _int(self.prompt_lookup_max)
                 and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max, name,
                 "need integers 1 <= prompt_lookup_min <= prompt_lookup_max")
        _require(self.method != "draft_model" or bool(self.model), name,
                 "the draft_model method needs 'model' (the draft's directory)")
        _require(self.kv_cache_memory_bytes is None or (_int(self.kv_cache_memory_bytes)
                                                        and self.kv_cache_memory_bytes > 0),
                 name, "kv_cache_memory_bytes must be a positive integer")

    @classmethod
    def from_dict(cls, spec: dict) -> SpeculativeConfig:
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config: expected an object, got {spec!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        _require(not unknown, "speculative_config", f"unknown key(s) {unknown}; known: {sorted(known)}")
        _require("method" in spec, "speculative_config", "'method' is required")
        return cls(**spec)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to `model`
    # A Jinja chat template (or the path of a file holding one) replacing the tokenizer's, for chat requests.
    chat_template: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    attention_backend: str = "auto"
    # "auto": the native class of a registered architecture, else transformers' class with paged attention (the
    # fallback); "pagedllm": native classes only; "transformers": always the fallback (vLLM's model_impl)
    model_impl: str = "auto"
    # "int8": a dense checkpoint's decoder projections quantized at load to W8A8 (int8 weights per output column,
    # int8 activations per token at each call), on CPUs with AVX512-VNNI, as vLLM's CPU backend offers. None: as
    # the checkpoint is (a quantized checkpoint is read from its own quantization_config).
    quantization: str | None = None
    # Structured output's grammar engine when a request names none: "auto" (llguidance; xgrammar for an EBNF
    # grammar only xgrammar reads), "guidance" or "xgrammar" (engine.structured_output.compiler)
    structured_outputs_backend: str = "auto"
    device: str = "auto"  # "auto" (cuda when available) | "cpu" | "cuda" | "cuda:N"
    # Decode steps replay CUDA graphs on a GPU (engine/decode_graphs.py), one per batch-size bucket:
    # `cuda_graph_sizes` (default: 1, 2, 4, then every 8, up to max_num_seqs, which is added), as vLLM's;
    # `enforce_eager` turns them off. Sizes given where graphs cannot run (CPU, ...) are refused, saying why.
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # A SpeculativeConfig, or the same as a dict (engine.json, LLM(...)): converted and validated on creation.
    speculative_config: SpeculativeConfig | None = None
    # Ranks the model is split over (1: no parallelism). cache.kv_cache_memory_bytes is per rank (as vLLM's
    # memory settings are per GPU): each rank holds its share of the KV heads of every block.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # only 1: see docs/ARCHITECTURE.md, "Pipeline parallelism"
    log_stats: bool = False  # the periodic one-line engine log
    log_stats_interval_s: float = 5.0
    # CPU kernel switches (bf16 on CPU only; for A/B measurements), reported in EngineStats.kernels.
    fused_cpu_ops: bool = field(default_factory=lambda: _env_default("PAGEDLLM_FUSED_CPU_OPS"))
    amx_linear: bool = field(default_factory=lambda: _env_default("PAGEDLLM_AMX_LINEAR"))
    # Prompts' attention, and wide GQA groups' decodes, on the AMX tile unit where the CPU has one (the cpu
    # backend; attention_amx.h)
    amx_attention: bool = field(default_factory=lambda: _env_default("PAGEDLLM_AMX_ATTENTION"))
    # Steps (decodes and prompts) through the decoder's layers in one C++ call (models/decoder_loop.py)
    cpu_decoder_loop: bool = field(default_factory=lambda: _env_default("PAGEDLLM_CPU_DECODER_LOOP"))
    # glibc malloc keeps freed memory (no mmap per large activation; engine/cpu_allocator.py), process-wide
    cpu_malloc_tuning: bool = field(default_factory=lambda: _env_default("PAGEDLLM_CPU_MALLOC_TUNING"))
    fault_injection: FaultInjection | None = None  # test-only (a dict is converted)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be > 0")
        _require(self.model_impl in ("auto", "pagedllm", "transformers"), "model_impl",
                 f"must be auto, pagedllm or transformers, got {self.model_impl!r}")
        _require(self.quantization in (None, "int8"), "quantization",
                 f"must be int8 (W8A8 at load, on CPU) or unset, got {self.quantization!r}; a quantized checkpoint "
                 "(AWQ, GPTQ, FP8) needs no setting")
        _require(isinstance(self.enforce_eager, bool), "enforce_eager", f"must be true or false, got {self.enforce_eager!r}")
        _require(self.cuda_graph_sizes is None or (
            isinstance(self.cuda_graph_sizes, (list, tuple)) and self.cuda_graph_sizes
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in self.cuda_graph_sizes)),
            "cuda_graph_sizes", f"must be a non-empty list of batch sizes > 0, got {self.cuda_graph_sizes!r}")
        _require(self.cuda_graph_sizes is None or not self.enforce_eager, "cuda_graph_sizes",
                 "cannot be given with enforce_eager (which captures none)")
        _require(self.cuda_graph_sizes is None or max(self.cuda_graph_sizes) <= self.scheduler.max_num_seqs,
                 "cuda_graph_sizes", f"a size above max_num_seqs ({self.scheduler.max_num_seqs}) would never "
                 f"replay, got {self.cuda_graph_sizes!r}")
        _require(self.structured_outputs_backend in STRUCTURED_OUTPUT_BACKENDS, "structured_outputs_backend",
                 f"must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, got {self.structured_outputs_backend!r}")
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        _require(self.pipeline_parallel_size == 1, "pipeline_parallel_size",
                 f"only 1 is supported (got {self.pipeline_parallel_size!r}); split the model with "
                 "tensor_parallel_size instead")
        for name in ("fused_cpu_ops", "amx_linear", "amx_attention", "cpu_decoder_loop", "cpu_malloc_tuning"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if isinstance(self.fault_injection, dict):
            object.__setattr__(self, "fault_injection", FaultInjection(**self.fault_injection))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        """Sort flat keyword arguments into the nested configs; unknown names are an error."""
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig, "limits": RequestLimits, "lora": LoRAConfig}
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
        return cls(model=model, **{name: klass(**nested[name]) for name, klass in groups.items()}, **top)
