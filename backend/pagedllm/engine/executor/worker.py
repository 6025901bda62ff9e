"""One rank's share of the work: its shard of the model (all of it without tensor parallelism) and, once the
engine has sized the KV cache, the runner that executes steps on it.

The worker composes the model's transforms, in order: build (models.loader) -> shard (distributed, with tensor
parallelism) -> load the weights -> LoRA slots around the target modules (with enable_lora) -> pack bf16 CPU
linears -> hand the fused CPU ops to the layers; once the KV cache is sized, the C++ loop over the layers where
they can run in it. The model definitions know none of these steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.distributed.comm import TensorParallelGroup
from pagedllm.distributed.tensor_parallel import shard_model
from pagedllm.engine.cpu_allocator import keep_freed_memory
from pagedllm.engine.decode_graphs import DecodeGraphs
from pagedllm.engine.kv_calibration import calibrate_kv_scales
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.step_inputs import StepInputs
from pagedllm.models.decoder_loop import attach_decoder_loop
from pagedllm.models.layers.fused import load_decoder_loop, load_fused_ops, load_lora_kernel, use_fused_ops
from pagedllm.models.layers.int8_linear import quantize_to_int8
from pagedllm.models.layers.moe import FusedMoE, pack_experts
from pagedllm.models.layers.packed_linear import pack_linears
from pagedllm.models.layers.quantized_linears import finish_quantized_linears, replace_quantized_linears
from pagedllm.models.quantization.config import read_quantization_config
from pagedllm.models.loader import build_model, load_weights
from pagedllm.models.lora.layers import LoRAModel


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build its shard: the same on every rank (rank 0 broadcasts it to the others)."""

    model: str
    dtype: torch.dtype
    device: str
    block_size: int
    fused_cpu_ops: bool
    amx_linear: bool
    max_loras: int = 0  # LoRA slots (0: LoRA off)
    max_lora_rank: int = 0
    model_impl: str = "auto"
    kv_dtype: torch.dtype | None = None  # the KV cache's elements (None: the model's dtype)
    quantization: str | None = None  # "int8": W8A8 made at load (EngineConfig.quantization)
    cpu_decoder_loop: bool = True  # the layers in one C++ call where they can be (EngineConfig.cpu_decoder_loop)
    cpu_malloc_tuning: bool = True  # malloc keeps what steps free (EngineConfig.cpu_malloc_tuning)
    amx_attention: bool = True  # the cpu attention backend's prompts on AMX (EngineConfig.amx_attention)


def load_shard(spec: WorkerSpec, hf_config, device: str, group: TensorParallelGroup | None = None):
    """The model (or, with a group of several ranks, this rank's shard of it), loaded and ready to run; with
    LoRA slots, `model.lora` is its LoRAModel (None otherwise)."""
    model = build_model(hf_config, device, spec.model_impl)
    fallback = getattr(model, "is_fallback", False)
    if fallback and ((group is not None and group.world_size > 1) or spec.max_loras):
        raise ValueError(f"{hf_config.architectures[0]} runs through the transformers fallback, which supports "
                         "neither tensor parallelism nor LoRA")
    quantized = read_quantization_config(hf_config)
    # What quantized layers need for now: one rank, no LoRA, and a dense model pagedllm implements itself.
    plain = not (fallback or (group is not None and group.world_size > 1) or spec.max_loras
                 or any(isinstance(m, FusedMoE) for m in model.modules()))
    if spec.quantization is not None:
        if quantized is not None:
            raise ValueError(f"quantization={spec.quantization!r}: the checkpoint is already quantized "
                             f"({quantized.method})")
        if device != "cpu" or not plain:
            raise ValueError("quantization='int8' runs on CPU, on one rank, without LoRA, for the dense "
                             "architectures pagedllm implements (not experts), for now")
    if quantized is not None:
        if not plain or model.checkpoint_splits(model.config):
            raise ValueError(f"{quantized.method} checkpoints run on one rank, without LoRA, for the dense "
                             "architectures pagedllm implements whose checkpoints keep q/k/v and gate/up apart (not "
                             "Phi-3's fused tensors, experts or the transformers fallback) for now")
        replace_quantized_linears(model, quantized)
    if group is not None and group.world_size > 1:
        with torch.device(device):
            shard_model(model, group)
    load_weights(model, spec.model, spec.dtype)
    if quantized is not None:
        finish_quantized_linears(model)
    if spec.quantization == "int8":
        quantize_to_int8(model)
    model.lora = LoRAModel(model, spec.max_loras, spec.max_lora_rank,
                           load_lora_kernel(device) if spec.fused_cpu_ops else None) if spec.max_loras else None
    if not fallback:  # transformers' modules may read their linears' .weight
        pack_linears(model, use_amx=spec.amx_linear)  # bf16 on CPU only; sharded layers stay as they are
        pack_experts(model)  # bf16 on CPU only (a tensor-parallel rank packs its rows of each expert)
    use_fused_ops(model, load_fused_ops(device) if spec.fused_cpu_ops else None)
    return model


class Worker:
    def __init__(self, spec: WorkerSpec, hf_config, device: str, group: TensorParallelGroup | None = None) -> None:
        self.spec, self.device = spec, device
        self.tensor_parallel = group is not None and group.world_size > 1
        self.model = load_shard(spec, hf_config, device, group)
        self.runner: ModelRunner | None = None

    def init_cache(self, num_blocks: int, backend, calibration_ids: list[int] | None = None) -> None:
        """The runner over a fresh cache; with `calibration_ids` (calculate_kv_scales), the fp8 cache's scales
        computed from one prefill of them first (every rank runs it: the step's collectives need them all, and
        each rank scales its own KV heads)."""
        if self.device == "cpu" and self.spec.cpu_malloc_tuning:  # after the load: its temporaries go back first
            keep_freed_memory()
        self.runner = ModelRunner(self.model, num_blocks, self.spec.block_size,
                                  self.spec.kv_dtype or self.spec.dtype, backend, self.device, self.model.lora)
        if calibration_ids:  # before the C++ loop, which takes the scales as they are when it is attached
            calibrate_kv_scales(self.runner, self.model, calibration_ids, self.spec.block_size)
        # A rank's shard needs its collectives between the layers' kernels: the modules keep those steps.
        if self.spec.cpu_decoder_loop and not self.tensor_parallel:  # without the fused ops it logs why not
            attach_decoder_loop(self.model, self.runner.kv_caches, backend, load_decoder_loop(self.device))

    def capture_decode_graphs(self, sizes: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
        """Capture and check a CUDA graph per decode bucket; the sizes captured (none if the capture failed)."""
        graphs = DecodeGraphs(self.runner, sizes, max_model_len)
        graphs.capture_all()
        if graphs.graphs:
            self.runner.graphs = graphs
        return tuple(sorted(graphs.graphs))

    def execute_step(self, step: StepInputs) -> torch.Tensor:
        return self.runner.execute_step(step)
