"""The Triton Python-backend model (decoupled). The only module that imports triton_python_backend_utils.

Threads: Triton calls `execute` (parse, validate, enqueue: never blocks on the engine); the engine loop thread
runs steps; the response thread turns engine outputs into Triton responses, sends them, and sweeps for
cancelled requests; the metrics thread publishes gauges.

Every response goes through the request's ResponseChannel, which the final response closes: no sender is used
after it (Triton 24.10 crashes the server on `is_cancelled()` after a final response). Every call from these
threads into triton_python_backend_utils holds IPC_LOCK: the stub's shared-memory allocator has no lock of its
own (it relies on the GIL, which some calls release while they wait for tritonserver), and concurrent calls
from two threads were seen to corrupt it (a general-protection fault in the stub). A malformed request
gets one INVALID_ARG error and touches nothing else. A failure that belongs to one request ends it with an
INTERNAL error. A dead engine fails every in-flight request once, then recovers: under explicit model control
the model unloads itself (NOT READY) and loads itself again (a fresh process and engine) with bounded,
backed-off attempts (`engine_restart: "reload"`, which `pagedllm serve` sets); otherwise, and in the other
modes, where Triton 24.10 lets a model neither unload nor report NOT READY, the engine is rebuilt in this
process and requests are refused with UNAVAILABLE meanwhile. (Asking a server that is not under explicit
control to unload is no probe: the stub's handling of that refusal was seen to corrupt its memory.)
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from pagedllm.config import EngineConfig, ServingConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.scheduler import QueueFullError
from pagedllm.models.checkpoint import load_tokenizer
from pagedllm.serving.cancellation import due_for_asking
from pagedllm.serving.engine_channel import ChannelServer, ChannelStream
from pagedllm.serving.engine_loop import EngineDeadError, EngineLoop
from pagedllm.serving.metrics import MetricsPublisher
from pagedllm.serving.multi_lora import with_multi_lora
from pagedllm.serving.placement import instance_device
from pagedllm.serving.request_parser import InvalidRequest, parse_request
from pagedllm.serving.response_builder import ResponseBuilder, coalesce
from pagedllm.serving.response_channel import ResponseChannel

logger = logging.getLogger("pagedllm.serving")

ENGINE_ARGS_FILE = "engine.json"
CANCEL_SWEEP_S = 0.02  # how often the response thread sweeps in-flight requests for client cancellation
# Each request is asked at least this often; a sweep asks only its share of them (serving/cancellation.py).
# Every ask is an IPC round trip to tritonserver: asking all 64 in flight every 20 ms kept a third core's worth
# of work running beside the forward pass on a 2-core host (measured with py-spy), which OpenMP's threads pay for.
CANCEL_CHECK_PERIOD_S = 0.2
# A request with the `heartbeat` parameter gets an empty response after each this long without one. Triton's HTTP
# front end notices a closed connection only when it writes to it (triton-inference-server/server#7077), so a
# request that sends nothing for a while (queued, in a long prefill, or final-only) would otherwise run on for a
# client that left; the heartbeat's write fails, Triton marks the request cancelled, and the sweep aborts it.
HEARTBEAT_S = 0.5
# A config parameter this model sets on itself when it reloads after an engine failure: the restarts so far.
RESTARTS_PARAMETER = "pagedllm_engine_restarts"
# One per stub process, like the allocator it guards (re-entrant: a channel's send may run under it).
IPC_LOCK = threading.RLock()


class _TritonStream:
    """One Triton request's way back: its ResponseChannel, each response built under IPC_LOCK. The engine
    channel's ChannelStream has the same four methods."""

    def __init__(self, channel: ResponseChannel) -> None:
        self.channel = channel

    def send_outputs(self, arrays: dict, final: bool = False) -> None:
        with IPC_LOCK:
            response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in arrays.items()])
        self.channel.send(response, final=final)

    def send_error(self, message: str, code: str = "INTERNAL") -> None:
        with IPC_LOCK:
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError,
                                                                                              code)))
        self.channel.send(response, final=True)

    def send_heartbeat(self) -> None:
        with IPC_LOCK:
            empty = pb_utils.InferenceResponse(output_tensors=[])
        self.channel.send(empty)  # nothing, once the request's final response went out

    def is_cancelled(self) -> bool:
        return self.channel.is_cancelled()


@dataclass
class _InFlight:
    stream: _TritonStream | ChannelStream
    builder: ResponseBuilder
    triton_id: str
    cancelled: bool = False
    asked_at: float = dataclasses.field(default_factory=time.monotonic)  # last asked whether it was cancelled
    sent_at: float = dataclasses.field(default_factory=time.monotonic)  # its last response (heartbeats included)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        started = time.monotonic()
        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("pagedllm needs `model_transaction_policy { decoupled: true }`")
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        self.serving, engine_args = ServingConfig.split(self._engine_args(version_dir))
        logging.basicConfig(level=logging.INFO, format="[pagedllm] %(levelname)s %(name)s: %(message)s")
        engine_args["device"] = instance_device(args.get("model_instance_kind", "MODEL"),
                                                args.get("model_instance_device_id", "0"),
                                                engine_args.get("device", "auto"))
        self.engine_config = EngineConfig.from_kwargs(**engine_args)
        self.restarts_before = int(self._param(RESTARTS_PARAMETER, "0"))  # by earlier loads of this model
        self.inflight: dict[str, _InFlight] = {}
        self.lock = threading.Lock()
        self.intake_lock = threading.Lock()
        self.ids = itertools.count()
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.num_rejected = 0
        self.num_cancelled = 0
        self.reloader: threading.Thread | None = None
        self.metrics = None
        self.engine_channel: ChannelServer | None = None
        self.loop = EngineLoop(self._build_engine, self._on_output, on_dead=self._on_engine_dead,
                               max_restarts=self.serving.max_engine_restarts,
                               backoff_s=self.serving.engine_restart_backoff_s, freeze_heap=True)
        # Requests are tokenized and validated on Triton's thread with the adapter's own tokenizer; the engine
        # thread detokenizes with the engine's. The two are never shared across threads.
        cfg = self.engine_config
        tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
        self.inputs = InputProcessor(tokenizer, self.loop.engine.model_info, cfg.limits, cfg.chat_template, cfg.lora,
                                     cfg.structured_outputs_backend)
        if self._param("enable_metrics", "true").lower() == "true" and self.serving.enable_metrics:
            labels = {"model": self.model_name, "version": str(args["model_version"])}
            self.metrics = MetricsPublisher(pb_utils, lambda: self.loop.engine, labels, lambda: {
                "requests_rejected": self.num_rejected, "requests_cancelled": self.num_cancelled,
                "engine_restarts": self.restarts_before + self.loop.restarts}, ipc_lock=IPC_LOCK)
        self.response_thread = threading.Thread(target=self._response_loop, name="pagedllm-responses",
                                                daemon=True)
        self.response_thread.start()
        self.engine_channel = self._open_channel()
        logger.info("model %s ready in %.1f s (engine args %s, %s, %d engine restarts before this load)",
                    self.model_name, time.monotonic() - started, engine_args, self.serving, self.restarts_before)

    def _open_channel(self) -> ChannelServer | None:
        """The engine channel for `pagedllm openai`, where engine.json's `openai_channel` names its socket."""
        if not self.serving.openai_channel:
            return None
        try:
            return ChannelServer(self.serving.openai_channel, self._accept_from_channel, self._cancel_from_channel)
        except OSError as e:  # the path is unusable: Triton's endpoints remain
            logger.warning("no engine channel on this instance: %s", e)
            return None

    def _build_engine(self) -> LLMEngine:
        engine = LLMEngine(self.engine_config)
        if self.metrics is not None:  # a restarted engine records its measurements from its first step on
            engine.enable_observations()
        return engine

    def _param(self, key: str, default: str) -> str:
        return self.model_config.get("parameters", {}).get(key, {}).get("string_value", default)

    @staticmethod
    def _engine_args(version_dir: str) -> dict:
        path = os.path.join(version_dir, ENGINE_ARGS_FILE)
        with open(path) as f:
            args = json.load(f)
        if "model" not in args:
            raise pb_utils.TritonModelException(f"{path}: 'model' (the checkpoint directory) is required")
        for key in ("model", "tokenizer", "chat_template"):  # relative paths are relative to the version directory
            value = args.get(key)
            if value and not os.path.isabs(value) and not (key == "chat_template" and "{" in value):
                args[key] = os.path.normpath(os.path.join(version_dir, value))
        return with_multi_lora(args, version_dir)

    # --- Triton's thread ---------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            self._accept(request)

    def _accept(self, request) -> None:
        received = time.monotonic()  # the engine takes it between steps: its wait for one counts as queued
        with IPC_LOCK:
            stream = _TritonStream(ResponseChannel(request.get_response_sender(),
                                                   pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, IPC_LOCK))
            triton_id = request.request_id() or ""
        self._admit(stream, lambda: self._triton_inputs(request), triton_id, received)

    @staticmethod
    def _triton_inputs(request) -> tuple[dict, dict]:
        with IPC_LOCK:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            raw_parameters = request.parameters()
        parameters = {k: v for k, v in json.loads(raw_parameters or "{}").items()
                      if not k.startswith("triton_")}  # triton_* are the frontend's own
        return inputs, parameters

    def _accept_from_channel(self, stream: ChannelStream, inputs: dict, parameters: dict) -> None:
        self._admit(stream, lambda: (inputs, parameters), "", time.monotonic())

    def _admit(self, stream, read_inputs, triton_id: str, received: float) -> None:
        """Read (`read_inputs()`: the inputs by name and the parameters), parse, tokenize and validate one
        request, Triton's or the engine channel's, then queue it; any failure is that request's error alone."""
        try:
            with self.intake_lock:  # Triton's thread and the channel's readers share the tokenizer
                processed, parsed = self._process(*read_inputs())
        except (InvalidRequest, ValueError) as e:
            self._reject(stream, str(e), "INVALID_ARG", triton_id)
            return
        except Exception as e:  # anything else about this one request (a tokenizer failure, say)
            logger.exception("could not process request %s", triton_id or "-")
            self._reject(stream, f"could not process the request: {type(e).__name__}: {e}", "INTERNAL", triton_id)
            return
        processed = dataclasses.replace(processed, arrival_time=received)
        rid = f"{next(self.ids)}:{triton_id}" if triton_id else str(next(self.ids))
        stream.rid = rid  # a channel's cancellation names the stream
        with self.lock:  # registered first: the engine thread may answer before submit returns
            self.inflight[rid] = _InFlight(stream, ResponseBuilder(parsed, len(processed.prompt_token_ids),
                                                                    self.engine_config.cache.block_size),
                                           triton_id)
        try:
            self.loop.submit(rid, processed)
        except EngineDeadError as e:
            with self.lock:
                state = self.inflight.pop(rid, None)
            if state is not None:  # else finalize took it meanwhile and sent its error
                self._reject(stream, str(e), "UNAVAILABLE", triton_id)

    def _process(self, inputs: dict, parameters: dict):
        parsed = parse_request(inputs, parameters, self.engine_config.limits)
        if parsed.pad_id is not None:
            self.inputs.check_token_ids("pad_id", [parsed.pad_id])
        if parsed.messages is not None:
            processed = self.inputs.process_chat(parsed.messages, parsed.params, parsed.priority, parsed.timeout,
                                                 lora=parsed.lora)
        else:
            processed = self.inputs.process(parsed.prompt, parsed.params, parsed.priority, parsed.timeout,
                                            parsed.lora)
        return processed, parsed

    def _reject(self, stream, message: str, code: str, triton_id: str) -> None:
        self.num_rejected += 1
        self._send_error(stream, message, code, triton_id)

    def _cancel_from_channel(self, stream: ChannelStream) -> None:
        """The front end cancelled a request, or went away: abort it now (no sweep needed)."""
        with self.lock:
            state = self.inflight.get(stream.rid) if stream.rid is not None else None
        if state is not None:
            self._abort_cancelled(stream.rid, state)

    def _abort_cancelled(self, rid: str, state: _InFlight) -> None:
        """Abort a request its client cancelled, once: the channel's reader and the response thread's sweep may
        both see the same cancellation."""
        with self.lock:
            if state.cancelled:
                return
            state.cancelled = True
            self.num_cancelled += 1
        self.loop.abort(rid)

    # --- engine thread -----------------------------------------------------------------------
    def _on_output(self, rid, out, err) -> None:
        self.responses.put((rid, out, err))  # sending happens on the response thread

    def _on_engine_dead(self, err: Exception) -> bool:
        """In-flight requests already got their errors. With engine_restart "reload": unload this model (it
        reports NOT READY) and load it again from a thread of ours (True: the loop need not restart the engine).
        Otherwise False: the loop restarts the engine in process."""
        if self.serving.max_engine_restarts == 0:
            logger.error("engine died (%s); restarts are off (max_engine_restarts 0)", err)
        if self.serving.engine_restart != "reload":
            logger.error("engine died (%s): restarting it in process; requests get UNAVAILABLE meanwhile", err)
            return False
        try:
            with IPC_LOCK:
                pb_utils.unload_model(self.model_name)
        except Exception as e:
            logger.error("engine died (%s); the model cannot unload itself (%s: is the server under explicit model "
                         "control?): restarting the engine in process", err, str(e).splitlines()[0])
            return False
        logger.error("engine died (%s): model %s unloaded (NOT READY); it will load itself again", err,
                     self.model_name)
        if self.engine_channel is not None:
            self.engine_channel.stop_listening()  # front ends wait for the next instance, which takes the path
        self.reloader = threading.Thread(target=self._reload, name="pagedllm-reload", daemon=True)
        self.reloader.start()
        return True

    def _reload(self) -> None:
        """Load this model again, with the restart count carried in its config; attempts backed off. This
        instance's metric families are released first: the new instance makes its own, of the same names."""
        if self.metrics is not None:
            self.metrics.stop()
        config = copy.deepcopy(self.model_config)
        restarts = self.restarts_before + self.loop.restarts + 1
        config.setdefault("parameters", {})[RESTARTS_PARAMETER] = {"string_value": str(restarts)}
        for attempt in range(self.serving.max_engine_restarts):
            time.sleep(self.serving.engine_restart_backoff_s * 2 ** attempt)
            try:
                with IPC_LOCK:  # held while the new instance loads: nothing else of ours talks to Triton then
                    pb_utils.load_model(self.model_name, config=json.dumps(config))
                logger.warning("model %s loaded again (engine restart %d)", self.model_name, restarts)
                return
            except Exception as e:
                logger.error("loading %s again failed (attempt %d of %d): %s", self.model_name, attempt + 1,
                             self.serving.max_engine_restarts, e)
        logger.error("model %s stays unloaded: load it through the repository API once the cause is fixed",
                     self.model_name)

    # --- response thread ---------------------------------------------------------------------
    def _response_loop(self) -> None:
        last_sweep = time.monotonic()
        while True:
            batch = self._drain()
            stop = batch and batch[-1] is None
            for item in self._first_responses_first(coalesce(batch[:-1] if stop else batch)):
                try:
                    self._respond(*item)
                except Exception:  # one broken response must not stop the others
                    logger.exception("failed to send a response for %s", item[0])
            if self.engine_channel is not None:
                self.engine_channel.flush()  # the batch's events for each front end: one write each
            if stop:
                return
            now = time.monotonic()
            if now - last_sweep >= CANCEL_SWEEP_S:
                self._sweep_cancellations(now, now - last_sweep)
                last_sweep = now

    def _first_responses_first(self, items: list) -> list:
        """The batch in order, except that requests yet to get a token (heartbeats are not tokens) go first: a
        step's outputs are sent one by one, each a round trip to tritonserver (64 took ~50 ms on 2 busy cores), and
        a new request's first token (its TTFT) should not wait behind the other streams' next ones."""
        with self.lock:
            fresh = {rid for rid, _, _ in items
                     if (state := self.inflight.get(rid)) is not None and state.builder.tokens_so_far == 0}
        return sorted(items, key=lambda item: item[0] not in fresh) if fresh else items

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
            if not isinstance(err, EngineDeadError):  # the engine refused it (overloaded)
                self.num_rejected += 1
            code = "UNAVAILABLE" if isinstance(err, (QueueFullError, EngineDeadError)) else "INVALID_ARG"
            self._finish(rid, state, error=(str(err), code))
            return
        reasons = {c.finish_reason for c in out.outputs}
        if "abort" in reasons:
            msg = "request was cancelled" if state.cancelled else "request aborted: the model is being unloaded"
            self._finish(rid, state, error=(msg, "CANCELLED" if state.cancelled else "UNAVAILABLE"))
            return
        if "error" in reasons:
            if not out.finished:  # one sample of several failed: the request fails, its other samples stop
                self.loop.abort(rid)
            self._finish(rid, state, error=(f"request failed: {out.error}", "INTERNAL"))
            return
        arrays = state.builder.arrays_for(out)
        if out.finished:
            self._finish(rid, state, arrays=arrays)
        else:
            state.sent_at = time.monotonic()
            state.stream.send_outputs(arrays)

    def _finish(self, rid, state: _InFlight, arrays=None, error=None) -> None:
        with self.lock:
            self.inflight.pop(rid, None)
        if error is not None:
            self._send_error(state.stream, error[0], error[1], state.triton_id)
        else:
            state.stream.send_outputs(arrays, final=True)

    def _sweep_cancellations(self, now: float, since_last_sweep_s: float) -> None:
        with self.lock:
            live = {rid: s for rid, s in self.inflight.items() if not s.cancelled}
        for state in live.values():
            if state.builder.parsed.heartbeat and now - state.sent_at >= HEARTBEAT_S:
                state.sent_at = now
                state.stream.send_heartbeat()
        for rid in due_for_asking({rid: s.asked_at for rid, s in live.items()}, since_last_sweep_s,
                                  CANCEL_CHECK_PERIOD_S):
            state = live[rid]
            state.asked_at = now
            if state.stream.is_cancelled():  # False once its final response went out
                self._abort_cancelled(rid, state)

    @staticmethod
    def _send_error(stream, message: str, code: str, triton_id: str = "") -> None:
        """`code`: the name of Triton's error code (INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED)."""
        message = " ".join(message.split())[:1000]  # one line, bounded
        logger.info("request %s failed: %s", triton_id or "-", message)
        stream.send_error(message, code)

    # --- lifecycle ----------------------------------------------------------------------------
    def finalize(self) -> None:
        """Abort what is in flight (each gets a final error response), then join every thread."""
        logger.info("finalizing: %d requests in flight", len(self.inflight))
        if self.engine_channel is not None:
            self.engine_channel.stop_listening()  # nothing new reaches this instance
        self.loop.stop()  # aborts what runs, shuts the engine (and any tensor-parallel workers) down
        if self.loop.running:
            logger.error("engine thread did not stop in time")
        if self.reloader is not None:  # this process must outlive the load of its successor
            self.reloader.join()
        self.responses.put(None)
        self.response_thread.join()
        with self.lock:
            leftovers = list(self.inflight.items())
            self.inflight.clear()
        for _, state in leftovers:  # e.g. submitted after the loop stopped
            self._send_error(state.stream, "the model is being unloaded", "UNAVAILABLE", state.triton_id)
        if self.engine_channel is not None:
            self.engine_channel.close()  # sends what is queued (those errors included) first
        if self.metrics is not None:
            self.metrics.stop()
