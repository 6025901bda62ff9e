"""The Triton Python-backend model (decoupled). The only module that imports triton_python_backend_utils.

Threads: Triton calls `execute` (parse, tokenize, enqueue: never blocks on the engine); the engine loop
thread runs steps; the response thread turns engine outputs into Triton responses, sends them, and sweeps
for cancelled requests; the metrics thread publishes gauges.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.scheduler import QueueFullError
from pagedllm.serving.engine_loop import EngineDeadError, EngineLoop
from pagedllm.serving.metrics import MetricsPublisher
from pagedllm.serving.request_parser import InvalidRequest, parse_request
from pagedllm.serving.response_builder import ResponseBuilder, coalesce

logger = logging.getLogger("pagedllm.serving")

ENGINE_ARGS_FILE = "engine.json"
CANCEL_SWEEP_S = 0.02  # how often in-flight requests are checked for client cancellation


@dataclass
class _InFlight:
    sender: object
    builder: ResponseBuilder
    triton_id: str
    cancelled: bool = False


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("pagedllm needs `model_transaction_policy { decoupled: true }`")
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        engine_args = self._engine_args(version_dir)
        metrics_on = engine_args.pop("enable_metrics", True)
        logging.basicConfig(level=logging.INFO, format="[pagedllm] %(levelname)s %(name)s: %(message)s")
        self.engine = LLMEngine(EngineConfig.from_kwargs(**engine_args))
        # Requests are tokenized and validated on Triton's thread with the adapter's own tokenizer; the engine
        # thread detokenizes with the engine's. The two are never shared across threads.
        tokenizer = AutoTokenizer.from_pretrained(self.engine.config.tokenizer or self.engine.config.model)
        self.inputs = InputProcessor(tokenizer, self.engine.model_info)
        self.inflight: dict[str, _InFlight] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.num_rejected = 0
        self.num_cancelled = 0
        self.metrics = None
        if self._param("enable_metrics", "true").lower() == "true" and metrics_on:
            labels = {"model": self.model_name, "version": str(args["model_version"])}
            self.metrics = MetricsPublisher(pb_utils, self.engine, labels, lambda: {
                "requests_rejected": self.num_rejected, "requests_cancelled": self.num_cancelled})
        self.loop = EngineLoop(self.engine, self._on_output, on_dead=self._on_engine_dead)
        self.response_thread = threading.Thread(target=self._response_loop, name="pagedllm-responses",
                                                daemon=True)
        self.response_thread.start()
        logger.info("model %s ready (engine args %s)", self.model_name, engine_args)

    def _param(self, key: str, default: str) -> str:
        return self.model_config.get("parameters", {}).get(key, {}).get("string_value", default)

    @staticmethod
    def _engine_args(version_dir: str) -> dict:
        path = os.path.join(version_dir, ENGINE_ARGS_FILE)
        with open(path) as f:
            args = json.load(f)
        if "model" not in args:
            raise pb_utils.TritonModelException(f"{path}: 'model' (the checkpoint directory) is required")
        for key in ("model", "tokenizer"):  # relative paths are relative to the version directory
            if args.get(key) and not os.path.isabs(args[key]):
                args[key] = os.path.normpath(os.path.join(version_dir, args[key]))
        return args

    # --- Triton's thread ---------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            self._accept(request)
        return None

    def _accept(self, request) -> None:
        sender = request.get_response_sender()
        triton_id = request.request_id() or ""
        try:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            parameters = {k: v for k, v in json.loads(request.parameters() or "{}").items()
                          if not k.startswith("triton_")}  # triton_* are the frontend's own
            parsed = parse_request(inputs, parameters)
            processed = self.inputs.process(parsed.prompt, parsed.params, parsed.priority, parsed.timeout)
            rid = f"{next(self.ids)}:{triton_id}" if triton_id else str(next(self.ids))
            with self.lock:
                self.inflight[rid] = _InFlight(sender, ResponseBuilder(parsed, len(processed.prompt_token_ids)),
                                               triton_id)
            self.loop.submit(rid, processed)
        except (InvalidRequest, ValueError) as e:
            self.num_rejected += 1
            self._send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG, triton_id)
        except EngineDeadError as e:
            self.num_rejected += 1
            self._send_error(sender, str(e), pb_utils.TritonError.UNAVAILABLE, triton_id)

    # --- engine thread -----------------------------------------------------------------------
    def _on_output(self, rid, out, err) -> None:
        self.responses.put((rid, out, err))  # sending happens on the response thread

    def _on_engine_dead(self, err: Exception) -> None:
        """In-flight requests already got errors; make the model not ready (needs explicit model control)."""
        logger.error("engine died (%s): unloading model %s", err, self.model_name)
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as e:  # e.g. model control mode NONE
            logger.error("could not unload %s (%s); new requests get UNAVAILABLE errors", self.model_name, e)

    # --- response thread ---------------------------------------------------------------------
    def _response_loop(self) -> None:
        last_sweep = time.monotonic()
        while True:
            batch = self._drain()
            stop = batch and batch[-1] is None
            for item in coalesce(batch[:-1] if stop else batch):
                try:
                    self._respond(*item)
                except Exception:  # one broken response must not stop the others
                    logger.exception("failed to send a response for %s", item[0])
            if stop:
                return
            if time.monotonic() - last_sweep >= CANCEL_SWEEP_S:
                self._sweep_cancellations()
                last_sweep = time.monotonic()

    def _drain(self) -> list:
        """Everything queued (waiting up to one sweep interval for the first item)."""
        try:
            batch = [self.responses.get(timeout=CANCEL_SWEEP_S)]
        except queue.Empty:
            return []
        while batch[-1] is not None:
            try:
                batch.append(self.responses.get_nowait())
            except queue.Empty:
                break
        return batch

    def _respond(self, rid, out, err) -> None:
        with self.lock:
            state = self.inflight.get(rid)
        if state is None:
            return
        if err is not None:
            if not isinstance(err, EngineDeadError):  # the engine refused it (overloaded, bad input)
                self.num_rejected += 1
            code = pb_utils.TritonError.UNAVAILABLE if isinstance(err, (QueueFullError, EngineDeadError)) \
                else pb_utils.TritonError.INVALID_ARG
            self._finish(rid, state, error=(str(err), code))
            return
        reason = out.outputs[0].finish_reason
        if reason == "abort":
            msg = "request was cancelled" if state.cancelled else "request aborted: the model is being unloaded"
            code = pb_utils.TritonError.CANCELLED if state.cancelled else pb_utils.TritonError.UNAVAILABLE
            self._finish(rid, state, error=(msg, code))
            return
        arrays = state.builder.arrays_for(out)
        tensors = [pb_utils.Tensor(name, value) for name, value in arrays.items()]
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        if out.finished:
            self._finish(rid, state, response=response)
        else:
            state.sender.send(response)

    def _finish(self, rid, state: _InFlight, response=None, error=None) -> None:
        with self.lock:
            self.inflight.pop(rid, None)
        if error is not None:
            self._send_error(state.sender, error[0], error[1], state.triton_id)
        else:
            state.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _sweep_cancellations(self) -> None:
        with self.lock:
            live = [(rid, s) for rid, s in self.inflight.items() if not s.cancelled]
        for rid, state in live:
            if state.sender.is_cancelled():
                state.cancelled = True
                self.num_cancelled += 1
                self.loop.abort(rid)

    @staticmethod
    def _send_error(sender, message: str, code, triton_id: str = "") -> None:
        logger.info("request %s failed: %s", triton_id or "-", message)
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # --- lifecycle ----------------------------------------------------------------------------
    def finalize(self) -> None:
        """Abort what is in flight (each gets a final error response), then join every thread."""
        logger.info("finalizing: %d requests in flight", len(self.inflight))
        self.loop.stop()
        if self.loop.running:
            logger.error("engine thread did not stop in time")
        self.engine.shutdown()  # tensor-parallel worker processes end with the model
        self.responses.put(None)
        self.response_thread.join()
        with self.lock:
            leftovers = list(self.inflight.items())
            self.inflight.clear()
        for _, state in leftovers:  # e.g. submitted after the loop stopped
            self._send_error(state.sender, "the model is being unloaded", pb_utils.TritonError.UNAVAILABLE)
        if self.metrics is not None:
            self.metrics.stop()

