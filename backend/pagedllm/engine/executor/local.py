"""LocalExecutor: tensor_parallel_size 1, the whole model in this process."""

from __future__ import annotations

import torch

from pagedllm.engine.executor.worker import Worker, WorkerSpec
from pagedllm.engine.step_inputs import StepInputs


class LocalExecutor:
    healthy = True
    error = None

    def __init__(self, spec: WorkerSpec, hf_config) -> None:
        self.worker = Worker(spec, hf_config, spec.device)
        self.model = self.worker.model

    def init_cache(self, num_blocks: int, backend, calibration_ids: list[int] | None = None) -> None:
        self.worker.init_cache(num_blocks, backend, calibration_ids)

    def capture_decode_graphs(self, sizes: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
        return self.worker.capture_decode_graphs(sizes, max_model_len)

    def execute_step(self, step: StepInputs) -> torch.Tensor:
        return self.worker.execute_step(step)

    def shutdown(self) -> None:
        pass
