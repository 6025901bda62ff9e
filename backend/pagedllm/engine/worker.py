"""One rank's share of the work: its shard of the model (all of it without tensor parallelism) and, once the
engine has sized the KV cache, the runner that executes steps on it."""

from __future__ import annotations

import torch

from pagedllm.engine.model_runner import ModelRunner, StepInputs
from pagedllm.models.loader import load_model


class Worker:
    def __init__(self, model_dir: str, hf_config, dtype: torch.dtype, device: str, block_size: int,
                 rank: int = 0, world_size: int = 1) -> None:
        self.model = load_model(model_dir, hf_config, dtype, device, tp_rank=rank, tp_size=world_size)
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.runner: ModelRunner | None = None

    def init_cache(self, num_blocks: int, backend) -> None:
        self.runner = ModelRunner(self.model, num_blocks, self.block_size, self.dtype, backend, self.device)

    def execute_step(self, step: StepInputs) -> torch.Tensor:
        return self.runner.execute_step(step)
