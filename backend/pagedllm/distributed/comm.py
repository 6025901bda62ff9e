"""A tensor-parallel group: this process's rank in it, and the collectives the sharded layers call.

`init_group` joins torch.distributed's default group (gloo on CPU, NCCL on GPU) plus, when that is NCCL, a gloo
group for the control messages (step inputs are Python objects), and returns a `TensorParallelGroup` that the
executor owns and hands to the sharded layers: nothing here is module-level state. torch.distributed keeps one
default group per process, so a process hosts at most one tensor-parallel engine at a time (checked).
Every collective counts the bytes it moves, so perf/tensor_parallel.py can compare the traffic with theory.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

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


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    control: object = None  # the group for object broadcasts (None: the default group)
    stats: CommStats = field(default_factory=CommStats)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += t.numel() * t.element_size()
        dist.all_reduce(t)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor along the last dimension, in rank order."""
        t = t.contiguous()
        self.stats.all_gather_calls += 1
        self.stats.all_gather_bytes += t.numel() * t.element_size()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None):
        """Rank 0 sends `obj`; every rank returns it."""
        self.stats.broadcast_calls += 1
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def init_group(rank: int, world_size: int, store: dist.Store | None, backend: str,
               loopback: bool = True) -> TensorParallelGroup:
    """Join the group through `store`, or through torchrun's environment (MASTER_ADDR/PORT) when None.
    `loopback`: every rank runs on this host, so gloo's peer sockets listen on 127.0.0.1 only."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group already exists in this process: shut its engine down first "
                           "(one tensor-parallel engine per process)")
    if loopback:
        # Read by gloo when the group is built: its listening sockets bind the loopback interface's address.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    where = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT, **where)
    control = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend != "gloo" else None
    return TensorParallelGroup(rank, world_size, control)
