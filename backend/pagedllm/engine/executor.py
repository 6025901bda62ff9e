"""Executors run each step's model pass for the engine. The engine (scheduler, sampler, outputs) always lives
in the calling process, as rank 0; the executor decides where the other ranks live.

    LocalExecutor       tensor_parallel_size 1: the whole model in this process
    MultiprocExecutor   (pagedllm.distributed.executor) N ranks: rank 0 here, ranks 1..N-1 in worker processes

Both offer: `model` (rank 0's shard), `init_cache(num_blocks, backend)`, `execute_step(step) -> logits`,
`healthy` (False once a rank failed; `error` says why), `shutdown()`.
"""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.model_runner import StepInputs
from pagedllm.engine.worker import Worker


class LocalExecutor:
    healthy = True
    error = None

    def __init__(self, config: EngineConfig, hf_config, dtype: torch.dtype, device: str) -> None:
        self.worker = Worker(config.model, hf_config, dtype, device, config.cache.block_size)
        self.model = self.worker.model

    def init_cache(self, num_blocks: int, backend) -> None:
        self.worker.init_cache(num_blocks, backend)

    def execute_step(self, step: StepInputs) -> torch.Tensor:
        return self.worker.execute_step(step)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, hf_config, dtype: torch.dtype, device: str):
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config, hf_config, dtype, device)
    from pagedllm.distributed.executor import MultiprocExecutor

    return MultiprocExecutor(config, hf_config, dtype, device)
