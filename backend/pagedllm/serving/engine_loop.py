"""Runs the engine on a thread of its own; other threads talk to it only through a command queue.

The loop: apply queued adds/aborts, run one engine step, hand every output to `on_output`. `on_output` runs on
the engine thread, so it must only enqueue (the Triton adapter's response thread does the sending).
If a step raises, the engine is declared dead: every in-flight request gets the error and the loop ends.
"""

from __future__ import annotations

import logging
import queue
import threading
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
    def __init__(self, engine: LLMEngine, on_output: OnOutput,
                 on_dead: Callable[[Exception], None] | None = None) -> None:
        self.engine = engine
        self.on_output = on_output
        self.on_dead = on_dead  # called once, after in-flight requests got their errors
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.error: Exception | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

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
        """Abort everything in flight (each gets a final "abort" output) and join the thread."""
        self.commands.put(("stop",))
        self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                idle = not self.engine.has_unfinished_requests()
                self._apply_commands(block=idle)
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self.on_output(out.request_id, out, None)
        except Exception as e:  # a step failed: the engine state can no longer be trusted
            logger.error("engine loop died: %s", traceback.format_exc())
            self.error = e
            self._fail_all(EngineDeadError(f"engine failed: {type(e).__name__}: {e}"))
            if self.on_dead is not None:
                self.on_dead(e)
            return
        for rid in list(self.engine.scheduler.requests):
            self.on_output(rid, self.engine.abort_request(rid), None)

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

    def _fail_all(self, err: Exception) -> None:
        for rid in list(self.engine.scheduler.requests):
            self.on_output(rid, None, err)
        while True:  # requests still queued as commands
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self.on_output(cmd[1], None, err)
