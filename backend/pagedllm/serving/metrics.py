"""Engine metrics on Triton's metrics port, named like vLLM's with a `pagedllm:` prefix.

A thread of its own publishes every 100 ms: gauges and counters from the engine's stats snapshot, histogram
observations drained from the engine's queue (the per-token inter-token latency binned here first:
binned_histogram.py). With LoRA, `pagedllm:lora_requests_info` is vLLM's info gauge:
labels max_lora, running_lora_adapters and waiting_lora_adapters (adapter names, comma-separated), value the
time the labels were last current: as in vLLM, earlier combinations stay with their last time, and the
current one is the series with the largest value. A mixture-of-experts model adds
`pagedllm:moe_expert_tokens_total{layer, expert}`: the tokens routed to each expert of each MoE layer (the
expert load that balance dashboards plot). The engine loop never waits on a metric call. The engine may be
replaced (a restart after a failure) or absent meanwhile: counters carry on from where the previous engine
left them, and while there is none the gauges read empty.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

from pagedllm.engine import observations as obs
from pagedllm.serving.binned_histogram import BinnedHistogram

GAUGES = {
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting to be scheduled",
    "kv_cache_usage_perc": "Fraction of KV blocks in use (0-1)",
    "kv_blocks_total": "Usable KV blocks",
    "kv_blocks_free": "Free KV blocks",
}
# Cumulative EngineStats fields exported as <name>_total counters.
STAT_COUNTERS = {
    "prompt_tokens": "Prompt tokens computed (recomputation after preemption included)",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Requests preempted",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache",
    "spec_decode_num_drafts": "Speculative verification runs (one request, one step)",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted",
}
# Counters about requests' fates: rejected and cancelled are counted by the adapter.
ADAPTER_COUNTERS = {
    "requests_rejected": "Requests answered with an error before running (bad input, overloaded)",
    "requests_cancelled": "Requests cancelled by their client",
    "requests_timed_out": "Requests finished by their deadline",
    "engine_restarts": "Times the engine was rebuilt after a failure of the shared machinery",
}
_LATENCY = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0]
_REQUEST_TIME = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
HISTOGRAMS = {
    obs.TTFT: ("Time to first token", _LATENCY),
    obs.ITL: ("Time between consecutive tokens of a request", _LATENCY),
    obs.E2E: ("Arrival to finish", _REQUEST_TIME),
    obs.QUEUE: ("Arrival to first scheduled", _REQUEST_TIME),
    obs.PREFILL: ("First scheduled to first token", _REQUEST_TIME),
    obs.DECODE: ("First token to finish", _REQUEST_TIME),
    obs.PROMPT_TOKENS: ("Prompt length of finished requests", _TOKENS),
    obs.GENERATION_TOKENS: ("Generated tokens of finished requests", _TOKENS),
    obs.ITERATION_TOKENS: ("Tokens computed per engine step", _TOKENS),
}
# Observed once per streamed token: binned here and published as the histogram's series (binned_histogram.py).
BINNED = {obs.ITL}
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")

logger = logging.getLogger(__name__)


class MetricsPublisher:
    def __init__(self, pb_utils, current_engine: Callable[[], object], labels: dict[str, str],
                 adapter_counts: Callable[[], dict[str, int]], interval_s: float = 0.1, ipc_lock=None) -> None:
        """`ipc_lock`: held around every call into Triton's metric objects (see triton_model.py)."""
        self.current_engine = current_engine  # the engine serving now, or None while it is down
        self.adapter_counts = adapter_counts
        self.interval_s = interval_s
        self.engine = self.observations = None
        self.carried: dict[str, int] = {}  # engine counters as published when the previous engine went away
        self.blocks_total = 0
        family = pb_utils.MetricFamily

        def metric(name, desc, kind, extra_labels=None, **kw):
            fam = family(name=f"pagedllm:{name}", description=desc, kind=kind)
            self._families.append(fam)  # keep families alive as long as their metrics
            return fam.Metric(labels={**labels, **(extra_labels or {})}, **kw)

        self._families: list = []
        self.gauges = {n: metric(n, d, family.GAUGE) for n, d in GAUGES.items()}
        self.counters = {n: metric(f"{n}_total", d, family.COUNTER)
                         for n, d in {**STAT_COUNTERS, **ADAPTER_COUNTERS}.items()}
        success = family(name="pagedllm:request_success_total", description="Finished requests by reason",
                         kind=family.COUNTER)
        self._families.append(success)
        self.success = {r: success.Metric(labels={**labels, "finished_reason": r}) for r in FINISH_REASONS}
        self.histograms = {n: metric(n, d, family.HISTOGRAM, buckets=b) for n, (d, b) in HISTOGRAMS.items()
                           if n not in BINNED}
        self.binned = {n: BinnedHistogram(family, f"pagedllm:{n}", d, b, labels, self._families.append)
                       for n, (d, b) in HISTOGRAMS.items() if n in BINNED}
        per_pos = family(name="pagedllm:spec_decode_num_accepted_tokens_per_pos_total",
                         description="Draft tokens accepted, by position in the draft", kind=family.COUNTER)
        self._families.append(per_pos)
        self._labels = labels
        self.per_position_family, self.per_position = per_pos, []
        self.lora_family = family(name="pagedllm:lora_requests_info", kind=family.GAUGE,
                                  description="Running and waiting LoRA adapters (labels); value: last update time")
        self._families.append(self.lora_family)
        self.lora_info: dict[tuple, object] = {}  # label values -> its series
        self.moe_family = family(name="pagedllm:moe_expert_tokens_total", kind=family.COUNTER,
                                 description="Tokens routed to each expert, per MoE layer")
        self._families.append(self.moe_family)
        self.moe_tokens: dict[str, object] = {}  # "layer:expert" -> its counter
        self.published: dict[str, int] = {}
        self._lock = ipc_lock if ipc_lock is not None else threading.Lock()
        self._stop = threading.Event()
        self._follow(current_engine())  # now: the engine records observations from its first step on
        self._thread = threading.Thread(target=self._run, name="pagedllm-metrics", daemon=True)
        self._thread.start()

    def _advance(self, key: str, metric, value: int) -> None:
        """Counters only go up: increment by what is new since the last publish."""
        delta = value - self.published.get(key, 0)
        if delta > 0:
            metric.increment(delta)
            self.published[key] = value

    def _follow(self, engine) -> None:
        """A new engine (or none): the previous one's last counts go out, then counters continue from them."""
        if self.engine is not None:
            self._publish_engine(self.engine)
        self.carried = dict(self.published)
        self.engine = engine
        self.observations = engine.enable_observations() if engine is not None else None

    def _engine_counts(self, s) -> dict[str, int]:
        counts = {name: getattr(s, name) for name in STAT_COUNTERS}
        counts["requests_timed_out"] = s.requests_finished.get("timeout", 0)
        counts.update({f"success:{r}": s.requests_finished.get(r, 0) for r in FINISH_REASONS})
        counts.update({f"accepted_pos:{i}": v for i, v in enumerate(s.spec_decode_accepted_per_position)})
        counts.update({f"moe:{layer}:{e}": v for layer, per in s.moe_expert_tokens.items() for e, v in enumerate(per)})
        return {k: self.carried.get(k, 0) + v for k, v in counts.items()}

    def publish(self) -> None:
        with self._lock:
            engine = self.current_engine()
            if engine is not self.engine:
                self._follow(engine)
            for name, value in self.adapter_counts().items():
                self._advance(name, self.counters[name], value)
            if engine is None:  # down: nothing runs, waits or holds a block
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                    self.gauges[name].set(0)
                self.gauges["kv_blocks_free"].set(self.blocks_total)
            else:
                self._publish_engine(engine)

    def _publish_engine(self, engine) -> None:
        s = engine.get_stats()
        gauges = {"num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                  "kv_cache_usage_perc": s.kv_cache_usage, "kv_blocks_total": s.num_blocks_total,
                  "kv_blocks_free": s.num_blocks_free}
        for name, value in gauges.items():
            self.gauges[name].set(value)
        self.blocks_total = s.num_blocks_total
        counts = self._engine_counts(s)
        while len(self.per_position) < len(s.spec_decode_accepted_per_position):
            pos = str(len(self.per_position))
            self.per_position.append(self.per_position_family.Metric(labels={**self._labels, "position": pos}))
        for key, value in counts.items():
            kind, _, name = key.partition(":")
            if kind == "moe":
                metric = self._moe_counter(name)
            else:
                metric = (self.success[name] if kind == "success" else self.per_position[int(name)]
                          if kind == "accepted_pos" else self.counters[key])
            self._advance(key, metric, value)
        if s.lora_max:
            self._publish_lora(s)
        self._observe()

    def _moe_counter(self, name: str):
        if name not in self.moe_tokens:
            layer, expert = name.split(":")
            self.moe_tokens[name] = self.moe_family.Metric(labels={**self._labels, "layer": layer, "expert": expert})
        return self.moe_tokens[name]

    def _publish_lora(self, s) -> None:
        key = (str(s.lora_max), ",".join(s.lora_running), ",".join(s.lora_waiting))
        if key not in self.lora_info:
            labels = dict(zip(("max_lora", "running_lora_adapters", "waiting_lora_adapters"), key))
            self.lora_info[key] = self.lora_family.Metric(labels={**self._labels, **labels})
        self.lora_info[key].set(time.time())

    def _observe(self) -> None:
        for name, value in self.observations.drain():
            binned = self.binned.get(name)
            if binned is not None:
                binned.observe(value)
            else:
                self.histograms[name].observe(value)
        for binned in self.binned.values():
            binned.publish()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception:  # metrics must never take the model down; say what broke and go on
                logger.exception("publishing metrics failed")

    def stop(self) -> None:
        """Stop publishing, publish the final state, and release Triton's metric objects now, while the stub can
        still take them back (left to the interpreter's exit, their destructors crash the stub). Idempotent.

        A family is Triton's by name: a second instance of this model (loaded while this one goes away) would
        share them, and releasing them under it corrupts its memory. So an instance that reloads its model
        calls this before the load."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.publish()
        with self._lock:
            self.gauges = self.counters = self.success = self.histograms = self.binned = {}
            self.per_position, self.per_position_family = [], None
            self.lora_info, self.lora_family = {}, None
            self.moe_tokens, self.moe_family = {}, None
            self._families.clear()
            gc.collect()
