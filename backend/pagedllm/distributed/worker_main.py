"""A tensor-parallel worker process (ranks 1..N-1), started by MultiprocExecutor:

    python -m pagedllm.distributed.worker_main --rank R --world-size N --port P --model DIR ...

It checks in on rank 0's TCPStore, joins the group, loads its shard, receives the KV cache size and the
attention backend, then runs every broadcast step until it receives None. It exits by itself when its parent
(the engine's process) disappears.
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
from transformers import AutoConfig

from pagedllm.attention.selector import BUILDERS
from pagedllm.distributed import comm
from pagedllm.distributed.executor import CHECK_IN_KEY
from pagedllm.engine.worker import Worker

logger = logging.getLogger("pagedllm.worker")


def _exit_with_parent(parent_pid: int) -> None:
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--port", "--block-size", "--parent-pid"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--backend", "--model", "--dtype", "--device"):
        ap.add_argument(name, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    _exit_with_parent(args.parent_pid)
    if args.device == "cpu":  # the ranks share this host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // args.world_size))
    elif args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, is_master=False, timeout=timedelta(minutes=5))
    store.set(CHECK_IN_KEY.format(rank=args.rank), str(os.getpid()))
    comm.init_group(args.rank, args.world_size, store, args.backend)
    worker = Worker(args.model, AutoConfig.from_pretrained(args.model), getattr(torch, args.dtype), args.device,
                    args.block_size, args.rank, args.world_size)
    num_blocks, backend_name = comm.broadcast_object()
    worker.init_cache(num_blocks, BUILDERS[backend_name]())
    while (step := comm.broadcast_object()) is not None:
        worker.execute_step(step)
    comm.destroy_group()
    logger.info("stopped")


if __name__ == "__main__":
    main()
