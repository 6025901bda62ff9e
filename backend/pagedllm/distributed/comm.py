"""This process's place in the tensor-parallel group, and the collectives the sharded layers call.

One group per process (torch.distributed's default group): gloo on CPU, NCCL on GPU, plus a gloo group for
the control messages (step inputs are Python objects) when the default one is NCCL. Every collective counts
the bytes it moves, so perf/tensor_parallel.py can compare the traffic with theory.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Idle workers wait inside a broadcast for the next step, possibly for days: a dead peer is detected by its
# closed socket (gloo and NCCL both raise), not by this timeout, which only bounds a peer that hangs alive.
GROUP_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class CommStats:
    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0  # payload per rank (the tensor's size), not wire bytes
    all_gather_calls: int = 0
    all_gather_bytes: int = 0  # this rank's contribution
    broadcast_calls: int = 0


class _Group:
    rank = 0
    world_size = 1
    control = None  # the group for object broadcasts (None: the default group)
    stats = CommStats()


GROUP = _Group()


def backend_for(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def init_group(rank: int, world_size: int, store: dist.Store | None, backend: str) -> None:
    """Join the group through `store`, or through torchrun's environment (MASTER_ADDR/PORT) when None."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group already exists in this process: shut its engine down first "
                           "(one tensor-parallel engine per process)")
    where = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT, **where)
    GROUP.rank, GROUP.world_size = rank, world_size
    GROUP.control = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend != "gloo" else None
    GROUP.stats = CommStats()


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    GROUP.rank, GROUP.world_size, GROUP.control = 0, 1, None


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place."""
    GROUP.stats.all_reduce_calls += 1
    GROUP.stats.all_reduce_bytes += t.numel() * t.element_size()
    dist.all_reduce(t)
    return t


def all_gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along the last dimension, in rank order."""
    t = t.contiguous()
    GROUP.stats.all_gather_calls += 1
    GROUP.stats.all_gather_bytes += t.numel() * t.element_size()
    parts = [torch.empty_like(t) for _ in range(GROUP.world_size)]
    dist.all_gather(parts, t)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj=None):
    """Rank 0 sends `obj`; every rank returns it."""
    GROUP.stats.broadcast_calls += 1
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=GROUP.control)
    return box[0]
