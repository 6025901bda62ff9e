"""Runs the engine on a thread of its own; other threads talk to it only through a command queue.

The loop: apply queued adds/aborts, run one engine step, hand every output to `on_output`. `on_output` runs on
the engine thread, so it must only enqueue (the Triton adapter's response thread does the sending).

If a step raises, the shared machinery failed (per-request failures never leave `step`): every in-flight
request gets exactly one error, the engine is shut down, and `on_dead` is told. Unless `on_dead` takes over
the recovery (returns True), the loop rebuilds the engine with `make_engine`: up to `max_restarts` attempts in
a row, waiting `backoff_s`, then twice that, and so on, before each. While it is down every new request is
refused at once (EngineDeadError); once it is back, `on_up` is told and serving resumes.

Every engine is built on the engine thread too (the constructor waits for the first and raises its error).
Reason: torch's OpenMP runtime (libgomp) keeps a thread pool per thread that ever ran a parallel region, and
once the pools hold more threads than there are cores it stops letting idle workers spin between regions. An
engine loaded on one thread and stepped on another left two pools, and its steps ran 1.3x as long (125M
batch-1 decode 17.6 -> 23.1 ms, measured).

With `freeze_heap`, every object alive once an engine is built (its modules, tokenizer, tables: ~320k for a 125M
model) is moved out of the garbage collector's reach (`gc.freeze`, as vLLM's engine core does), so a full
collection scans only what serving allocated since. A full collection of the unfrozen heap took 170-360 ms in
the Triton stub (125M; measured at load and at unload); none ran within a few minutes of benchmark load, but a
long-running server crosses the threshold in time, and each would stall every stream. The heap is unfrozen
before an engine is dropped (a death, the stop), so what the old engine leaves in reference cycles can be
collected.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable

from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.input_processor import ProcessedRequest
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

OnOutput = Callable[[str, RequestOutput | None, Exception | None], None]


class EngineDeadError(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, make_engine: Callable[[], LLMEngine], on_output: OnOutput,
                 on_dead: Callable[[Exception], bool] | None = None, on_up: Callable[[], None] | None = None,
                 max_restarts: int = 3, backoff_s: float = 1.0, engine: LLMEngine | None = None,
                 freeze_heap: bool = False) -> None:
        """`engine`: one already built (else `make_engine` builds the first one, on the engine thread; its
        error, if any, is raised here). `freeze_heap`: freeze the heap once each engine is built (see above)."""
        self.make_engine = make_engine
        self.on_output = on_output
        self.on_dead = on_dead  # called once per death, after in-flight requests got their errors
        self.on_up = on_up  # called after each successful restart
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.freeze_heap = freeze_heap
        self.engine: LLMEngine | None = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.error: Exception | None = None  # why the engine is down (None while it serves)
        self.restarts = 0
        self._stopping = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.error is None and self.running

    # --- called from other threads ------------------------------------------------------------
    def submit(self, request_id: str, request: ProcessedRequest) -> None:
        """Queue a request validated by an InputProcessor (on the caller's thread)."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error}")
        self.commands.put(("add", request_id, request))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each gets a final "abort" output), shut the engine down, join the
        thread."""
        self.commands.put(("stop",))
        self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.engine is None:
                self.engine = self.make_engine()
            self._freeze()
        except BaseException as e:
            self._start_error = e
            return
        finally:
            self._started.set()
        while not self._stopping:
            try:
                self._serve()
            except Exception as e:  # a step failed: the engine's state can no longer be trusted
                logger.error("engine died: %s", traceback.format_exc())
                traceback.clear_frames(e.__traceback__)  # the failed step's frames hold the dead engine: drop it
                self._go_down(e)
                if self.on_dead is not None and self.on_dead(e):
                    self._refuse_until_stopped()
                elif not self._restart():
                    logger.error("engine not restarted after %d attempts; refusing requests", self.max_restarts)
                    self._refuse_until_stopped()
        self._unfreeze()
        if self.engine is not None:
            for rid in list(self.engine.scheduler.requests):
                self.on_output(rid, self.engine.abort_request(rid), None)
            self.engine.shutdown()

    def _freeze(self) -> None:
        if self.freeze_heap:
            gc.collect()  # what loading left as garbage is not frozen with the rest
            gc.freeze()

    def _unfreeze(self) -> None:
        if self.freeze_heap:
            gc.unfreeze()

    def _serve(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._apply_commands(block=not engine.has_unfinished_requests())
            if not self._stopping and engine.has_unfinished_requests():
                for out in engine.step():
                    self.on_output(out.request_id, out, None)

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self.commands.get(timeout=0.1) if block else self.commands.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = cmd[0]
            if kind == "add":
                _, rid, request = cmd
                try:
                    self.engine.add_request(request, request_id=rid)
                except Exception as e:  # queue full: this request only
                    self.on_output(rid, None, e)
            elif kind == "abort":
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self.on_output(cmd[1], out, None)
            elif kind == "stop":
                self._stopping = True

    def _go_down(self, err: Exception) -> None:
        """Every in-flight request gets one error; the dead engine is shut down and dropped."""
        self.error = err
        dead = EngineDeadError(f"engine failed: {type(err).__name__}: {err}")
        self._unfreeze()
        engine, self.engine = self.engine, None
        for rid in list(engine.scheduler.requests):
            self.on_output(rid, None, dead)
        self._drain_commands(dead, timeout=0)
        try:
            engine.shutdown()
        except Exception:
            logger.exception("shutting the dead engine down failed")

    def _restart(self) -> bool:
        for attempt in range(self.max_restarts):
            wait = self.backoff_s * 2 ** attempt
            logger.warning("restarting the engine in %.1f s (attempt %d of %d)", wait, attempt + 1, self.max_restarts)
            deadline = time.monotonic() + wait
            while not self._stopping and time.monotonic() < deadline:
                self._drain_commands(EngineDeadError("engine is restarting"), timeout=deadline - time.monotonic())
            if self._stopping:
                return True
            try:
                self.engine = self.make_engine()
            except Exception:
                logger.error("engine restart failed: %s", traceback.format_exc())
                continue
            self.restarts += 1
            self.error = None
            self._freeze()
            logger.warning("engine restarted (%d restarts so far)", self.restarts)
            if self.on_up is not None:
                self.on_up()
            return True
        return False

    def _refuse_until_stopped(self) -> None:
        while not self._stopping:
            self._drain_commands(EngineDeadError(f"engine is not running: {self.error}"), timeout=0.5)

    def _drain_commands(self, err: Exception, timeout: float) -> None:
        """While there is no engine: every queued add gets `err`, aborts have nothing to do, stop stops."""
        block = timeout > 0
        while True:
            try:
                cmd = self.commands.get(timeout=max(timeout, 0.001)) if block else self.commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                self.on_output(cmd[1], None, err)
            elif cmd[0] == "stop":
                self._stopping = True
                return
