"""MultiprocExecutor: tensor parallelism across processes.

Rank 0 is the engine's own process (the scheduler runs once, there). Ranks 1..N-1 are either worker processes
on this host (`python -m pagedllm.engine.executor.worker_main`), started here and stopped by `shutdown`, at
interpreter exit, or by their own watchdog when this process disappears; or, under torchrun (possibly across
nodes), the other torchrun processes, which the CLI turns into workers. Spawned workers check in on a TCPStore
while this side watches that they are alive (a worker that dies before joining is reported, not waited for),
then all join one torch.distributed group. Rank 0 broadcasts what to load (the WorkerSpec), then each step's
StepInputs;
every rank runs its shard (the sharded layers all-reduce and all-gather), rank 0 samples from the gathered
logits.

A worker that dies closes its sockets, so the collective rank 0 is in raises at once; the executor then kills
the other workers, leaves the group, and reports WorkerFailedError naming the rank and its exit status. The
engine is not healthy from then on.

Sockets stay on loopback: the rendezvous store listens on 127.0.0.1 only (a socket bound here is handed to it),
and so do gloo's peer connections when every rank is on this host.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm.distributed import comm
from pagedllm.distributed.tensor_parallel import check_shardable
from pagedllm.engine.executor.worker import Worker, WorkerSpec
from pagedllm.engine.step_inputs import StepInputs

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 300.0
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding the pagedllm package
CHECK_IN_KEY = "pagedllm/worker{rank}"


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank failed: the engine cannot continue."""


def rank_device(device: str, rank: int) -> str:
    if device.startswith("cuda"):
        base = int(device.split(":")[1]) if ":" in device else 0
        return f"cuda:{base + rank}"
    return device


def _python() -> str:
    """The interpreter for workers: inside Triton's Python stub, sys.executable is the stub, not Python."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return os.path.join(sys.prefix, "bin", "python3")


def _exit_status(code: int) -> str:
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec, hf_config, world: int) -> None:
        check_shardable(hf_config, world)  # before any process starts
        backend = comm.backend_for(spec.device)
        self.error: WorkerFailedError | None = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.group: comm.TensorParallelGroup | None = None
        self._store = None
        self._threads = torch.get_num_threads()
        self._active = True
        atexit.register(self.shutdown)
        try:
            if launched_by_torchrun():
                ranks_per_host = self._join_torchrun(world, backend)
            else:
                ranks_per_host = world
                self._spawn_workers(world, backend)
            if spec.device == "cpu":  # the ranks share this host's cores
                torch.set_num_threads(max(1, self._threads // ranks_per_host))
            self.group.broadcast_object((spec, ranks_per_host))
            self.worker = Worker(spec, hf_config, rank_device(spec.device, 0), self.group)
        except BaseException:
            self.shutdown()
            raise
        self.model = self.worker.model
        logger.info("tensor parallel: %d ranks over %s%s", world, backend,
                    f", worker pids {[p.pid for p in self.procs.values()]}" if self.procs else " (torchrun)")

    def _join_torchrun(self, world: int, backend: str) -> int:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if size != world or rank != 0:
            raise ValueError(f"tensor_parallel_size: {world}, but torchrun started {size} processes and this is "
                             f"rank {rank} (the engine runs on rank 0; the CLI turns other ranks into workers)")
        self.group = comm.init_group(0, world, None, backend, loopback=False)
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def _spawn_workers(self, world: int, backend: str) -> None:
        if backend == "nccl" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size: {world} needs {world} GPUs, {torch.cuda.device_count()} "
                             "visible")
        # The store's server would listen on every interface given a port; given a socket bound to loopback,
        # it listens there only. The store owns the socket (and closes it), held for the executor's life.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        self._store = store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=_STARTUP_TIMEOUT_S),
                                            master_listen_fd=listener.detach())
        for rank in range(1, world):
            self.procs[rank] = self._spawn(rank, world, port, backend)
        self._wait_for_check_in(store, world)
        self.group = comm.init_group(0, world, store, backend)

    def _spawn(self, rank: int, world: int, port: int, backend: str) -> subprocess.Popen:
        package_root = str(_PACKAGE_ROOT)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root,
                                                                        os.environ.get("PYTHONPATH")])))
        cmd = [_python(), "-m", "pagedllm.engine.executor.worker_main", "--rank", str(rank), "--world-size",
               str(world), "--port", str(port), "--backend", backend, "--parent-pid", str(os.getpid())]
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    def _wait_for_check_in(self, store: dist.TCPStore, world: int) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        waiting = set(range(1, world))
        while waiting:
            for rank in list(waiting):
                code = self.procs[rank].poll()
                if code is not None:
                    raise WorkerFailedError(f"tensor-parallel worker rank {rank} failed to start "
                                            f"({_exit_status(code)}); its log is above")
                if store.check([CHECK_IN_KEY.format(rank=rank)]):
                    waiting.discard(rank)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"tensor-parallel workers {sorted(waiting)} did not start within "
                                        f"{_STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    # --- the engine's interface -------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._active and self.error is None and all(p.poll() is None for p in self.procs.values())

    def init_cache(self, num_blocks: int, backend, calibration_ids: list[int] | None = None) -> None:
        self._collective(lambda: self.group.broadcast_object((num_blocks, backend.name, calibration_ids)))
        self._collective(lambda: self.worker.init_cache(num_blocks, backend, calibration_ids))

    def execute_step(self, step: StepInputs) -> torch.Tensor:
        def run():
            self.group.broadcast_object(step)
            return self.worker.execute_step(step)
        return self._collective(run)

    def _collective(self, fn):
        if not self.healthy:
            self._fail(None)
        try:
            return fn()
        except Exception as e:
            self._fail(e)

    def _fail(self, cause: Exception | None):
        """Record why the group is broken, stop every worker, and raise."""
        if self.error is None:
            dead = self._dead_workers(wait_s=2.0)
            what = ", ".join(f"rank {r} (pid {self.procs[r].pid}) {_exit_status(c)}" for r, c in dead)
            msg = (f"tensor-parallel worker died: {what}" if dead else
                   f"tensor-parallel step failed: {cause}" if cause else "the tensor-parallel workers are stopped")
            self.error = WorkerFailedError(msg)
            logger.error("%s; stopping all workers", msg)
            self.shutdown()
        raise self.error from cause

    def _dead_workers(self, wait_s: float) -> list[tuple[int, int]]:
        deadline = time.monotonic() + wait_s
        while True:  # the collective can fail a moment before the dead worker is reaped
            dead = [(r, p.poll()) for r, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Stop the workers (politely when the group still works) and leave the group. Idempotent."""
        if not self._active:
            return
        polite = self.healthy and self.group is not None and dist.is_initialized()
        self._active = False
        if polite:
            try:
                self.group.broadcast_object(None)  # workers leave their loop and exit
            except Exception as e:
                logger.warning("could not tell the workers to stop (%s): killing them", e)
                polite = False
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10 if polite else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = {}
        if self.group is not None:
            self.group.destroy()
        self._store = None  # closes the rendezvous server and its socket
        torch.set_num_threads(self._threads)
        atexit.unregister(self.shutdown)
