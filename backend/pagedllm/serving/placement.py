"""Where a Triton model instance's engine runs. Triton places each instance of an `instance_group`: KIND_GPU
instances on the GPUs listed (or every GPU), one per device, and tells the instance which (its
`model_instance_kind` and `model_instance_device_id`). A KIND_GPU instance runs on that device; a
tensor-parallel one on that device and the next tensor_parallel_size - 1. KIND_CPU runs on the CPU. KIND_MODEL
(our default) leaves the choice to engine.json's `device`. An engine.json device that contradicts Triton's
placement is refused: two instances would otherwise share one GPU while another sat idle."""

from __future__ import annotations


def instance_device(kind: str, device_id: int | str, configured: str) -> str:
    if kind == "GPU":
        placed = f"cuda:{int(device_id)}"
        if configured in ("auto", "cuda", placed):
            return placed
        raise ValueError(f"device: engine.json says {configured!r}, but Triton placed this KIND_GPU instance on "
                         f"{placed}; leave device \"auto\" (or use KIND_MODEL to choose it in engine.json)")
    if kind == "CPU":
        if configured in ("auto", "cpu"):
            return "cpu"
        raise ValueError(f"device: engine.json says {configured!r}, but this is a KIND_CPU instance")
    return configured
