"""Engine gauges on Triton's metrics port, published from a thread of their own so the engine loop never
waits on metric calls. Names follow vLLM's with a `pagedllm:` prefix."""

from __future__ import annotations

import threading

GAUGES = {
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting to be scheduled",
    "kv_cache_usage_perc": "Fraction of KV blocks in use (0-1)",
    "kv_blocks_total": "Usable KV blocks",
    "kv_blocks_free": "Free KV blocks",
}
COUNTERS = {
    "prompt_tokens": "Prompt tokens computed (recomputation after preemption included)",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Requests preempted",
}


class MetricsPublisher:
    def __init__(self, pb_utils, engine, labels: dict[str, str], interval_s: float = 0.1) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.families = {name: pb_utils.MetricFamily(name=f"pagedllm:{name}", description=desc,
                                                     kind=pb_utils.MetricFamily.GAUGE)
                         for name, desc in GAUGES.items()}
        self.families.update({name: pb_utils.MetricFamily(name=f"pagedllm:{name}_total", description=desc,
                                                          kind=pb_utils.MetricFamily.COUNTER)
                              for name, desc in COUNTERS.items()})
        self.metrics = {name: fam.Metric(labels=labels) for name, fam in self.families.items()}
        self.published = {name: 0 for name in COUNTERS}  # counters only go up: publish the deltas
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedllm-metrics", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        s = self.engine.get_stats()
        values = {"num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                  "kv_cache_usage_perc": s.kv_cache_usage, "kv_blocks_total": s.num_blocks_total,
                  "kv_blocks_free": s.num_blocks_free}
        for name, value in values.items():
            self.metrics[name].set(value)
        for name in COUNTERS:
            value = getattr(s, name)
            if value > self.published[name]:
                self.metrics[name].increment(value - self.published[name])
                self.published[name] = value

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.publish()  # leave the final state visible
