"""Tensor-parallel worker processes (ranks 1..N-1).

Started by MultiprocExecutor (`python -m pagedllm.engine.executor.worker_main --rank R ...`): check in on rank 0's
TCPStore, join the group. Or started by torchrun (`torchrun ... -m pagedllm.cli generate|batch ...`, where the
CLI hands ranks > 0 to `run_torchrun_worker`): join through torchrun's environment. Either way rank 0 then
broadcasts what to load (a WorkerSpec), the KV cache size and the attention backend, and
the worker runs every broadcast step until it receives None.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.attention.selector import build_backend
from pagedllm.distributed import comm
from pagedllm.engine.executor.multiproc import CHECK_IN_KEY, rank_device
from pagedllm.engine.executor.worker import Worker
from pagedllm.models.checkpoint import load_config

logger = logging.getLogger("pagedllm.worker")


def serve_steps(group: comm.TensorParallelGroup, local_rank: int) -> None:
    """The worker's life once it is in the group."""
    spec, ranks_per_host = group.broadcast_object()  # the WorkerSpec from rank 0
    device = rank_device(spec.device, local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    elif device == "cpu":  # the ranks share this host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // ranks_per_host))
    worker = Worker(spec, load_config(spec.model), device, group)
    num_blocks, backend_name, calibration_ids = group.broadcast_object()
    worker.init_cache(num_blocks, build_backend(backend_name, spec.amx_attention), calibration_ids)
    while (step := group.broadcast_object()) is not None:
        worker.execute_step(step)
    group.destroy()
    logger.info("stopped")


def run_torchrun_worker(device: str) -> None:
    """A rank > 0 under torchrun: join the group torchrun's environment describes and serve rank 0."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _log_as(rank)
    group = comm.init_group(rank, world, None, comm.backend_for(device), loopback=False)
    serve_steps(group, int(os.environ.get("LOCAL_RANK", rank)))


def _log_as(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")


def _exit_with_parent(parent_pid: int) -> None:
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--port", "--parent-pid"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--backend", required=True)
    args = ap.parse_args(argv)
    _log_as(args.rank)
    _exit_with_parent(args.parent_pid)
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, is_master=False, timeout=timedelta(minutes=5))
    store.set(CHECK_IN_KEY.format(rank=args.rank), str(os.getpid()))
    group = comm.init_group(args.rank, args.world_size, store, args.backend)
    serve_steps(group, args.rank)


if __name__ == "__main__":
    main()
