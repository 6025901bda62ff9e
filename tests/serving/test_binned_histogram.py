"""BinnedHistogram against a direct count of the same values: the published series are a histogram's
(cumulative buckets with le inclusive, +Inf, sum, count), and a publish moves only the series that changed.
(test_metrics.py checks the real server's scrape: the binned histogram's bounds print as Triton's own do.)"""

from __future__ import annotations

import math
import random

from pagedllm.serving.binned_histogram import BinnedHistogram, bound_label

BOUNDS = [0.001, 0.005, 0.01, 0.04, 0.1, 1.0, 2.5, 10.0]


class Counter:
    def __init__(self, calls: list, labels: dict) -> None:
        self.calls, self.labels, self.value = calls, labels, 0.0

    def increment(self, delta: float) -> None:
        assert delta > 0  # Triton's counters refuse anything else
        self.value += delta
        self.calls.append((self.labels.get("le"), delta))


class Family:
    COUNTER = "counter"
    calls: list = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        assert kind == Family.COUNTER and description
        self.name = name

    def Metric(self, labels: dict) -> Counter:  # noqa: N802 (pb_utils' name)
        return Counter(Family.calls, labels)


def make() -> tuple[BinnedHistogram, list]:
    Family.calls = []
    kept = []
    h = BinnedHistogram(Family, "pagedllm:x_seconds", "X", BOUNDS, {"model": "m"}, kept.append)
    assert [f.name for f in kept] == ["pagedllm:x_seconds_bucket", "pagedllm:x_seconds_sum",
                                      "pagedllm:x_seconds_count"]
    return h, Family.calls


def expected_cumulative(values: list[float]) -> list[int]:
    return [sum(v <= b for v in values) for b in [*BOUNDS, math.inf]]


def test_published_series_are_the_histogram_of_the_values():
    h, _ = make()
    rng = random.Random(0)
    seen: list[float] = []
    for batch in range(5):
        # on the bounds (le is inclusive), between them, and above the largest (+Inf only)
        values = [rng.choice(BOUNDS) for _ in range(7)] + [rng.uniform(0, 20) for _ in range(50)]
        for v in values:
            h.observe(v)
        h.publish()
        seen += values
        assert [s.value for s in h.bucket_series] == expected_cumulative(seen)
        assert [s.labels["le"] for s in h.bucket_series] == ["0.001", "0.005", "0.01", "0.04", "0.1", "1", "2.5",
                                                             "10", "+Inf"]
        assert h.count_series.value == len(seen)
        assert math.isclose(h.sum_series.value, sum(seen), rel_tol=1e-12)


def test_a_publish_moves_only_what_changed():
    h, calls = make()
    h.publish()
    assert calls == []  # nothing observed: no call into Triton
    for v in (0.02, 0.03, 0.035):  # all in the 0.04 bucket
        h.observe(v)
    h.publish()
    # the 0.04 bucket and every one above it, by 3 each, then the count and the sum: one call per series
    assert calls[:-2] == [(le, 3) for le in ("0.04", "0.1", "1", "2.5", "10", "+Inf")]
    assert calls[-2] == (None, 3) and math.isclose(calls[-1][1], 0.085)
    calls.clear()
    h.publish()
    assert calls == []
    h.observe(50.0)  # above every bound: +Inf, count and sum only
    h.publish()
    assert [le for le, _ in calls] == ["+Inf", None, None]


def test_bound_labels_print_as_tritons():
    assert [bound_label(b) for b in (0.001, 0.06, 0.75, 1.0, 7.5, 80.0, 7680.0, math.inf)] == [
        "0.001", "0.06", "0.75", "1", "7.5", "80", "7680", "+Inf"]
