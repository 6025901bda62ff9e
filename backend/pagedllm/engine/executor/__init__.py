"""Executors run each step's model pass for the engine. The engine (scheduler, sampler, outputs) always lives
in the calling process, as rank 0; the executor decides where the other ranks live.

    LocalExecutor       (local.py) tensor_parallel_size 1: the whole model in this process
    MultiprocExecutor   (multiproc.py) N ranks: rank 0 here, ranks 1..N-1 in worker processes (worker_main.py)

Both offer: `model` (rank 0's shard), `init_cache(num_blocks, backend, calibration_ids=None)`, `execute_step(step) -> logits`,
`healthy` (False once a rank failed; `error` says why), `shutdown()`. LocalExecutor also offers
`capture_decode_graphs(sizes, max_model_len)` (decode CUDA graphs are not captured under tensor parallelism).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.executor.worker import WorkerSpec
from pagedllm.engine.model_info import ModelInfo


def make_executor(config: EngineConfig, info: ModelInfo):
    lora = config.lora
    spec = WorkerSpec(config.model, info.dtype, info.device, config.cache.block_size, config.fused_cpu_ops,
                      config.amx_linear, lora.max_loras if lora.enable_lora else 0, lora.max_lora_rank,
                      config.model_impl, info.kv_dtype, config.quantization, config.cpu_decoder_loop,
                      config.cpu_malloc_tuning, config.amx_attention)
    if config.tensor_parallel_size == 1:
        from pagedllm.engine.executor.local import LocalExecutor

        return LocalExecutor(spec, info.hf_config)
    from pagedllm.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, info.hf_config, config.tensor_parallel_size)
