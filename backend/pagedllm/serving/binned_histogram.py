"""A Prometheus histogram binned here and published as its series, for a measurement taken too often to send
to Triton one value at a time.

Why: a Triton histogram takes one value per `observe` call, and from the Python backend's stub every call is a
round trip to tritonserver (two context switches on cores the forward pass is using). The inter-token latency
is observed once per streamed token: ~1,300 calls a second at 64 concurrent streams on a 2-core host, and the
served throughput there was 1.03x as high with metrics off (perf/README.md, session 34). Binned here, a publish
moves only the series that changed: at most one per bucket, plus the sum and the count.

What a scrape shows is a native histogram's samples, exactly: `<name>_bucket{le="..."}` (cumulative, `+Inf`
last), `<name>_sum`, `<name>_count`, with Triton's own formatting of the bounds. The difference: the three are
families of kind counter, so their TYPE lines say counter (PromQL's `histogram_quantile` over `rate(..._bucket)`
works on them as on any classic histogram).
"""

from __future__ import annotations

import bisect
import math


def bound_label(bound: float) -> str:
    """A bucket bound as Triton's histograms print it: 0.04, 1, 2.5, +Inf."""
    if math.isinf(bound):
        return "+Inf"
    return str(int(bound)) if bound == int(bound) else repr(bound)


class BinnedHistogram:
    def __init__(self, family, name: str, description: str, bounds: list[float], labels: dict[str, str],
                 keep_family) -> None:
        """`family`: pb_utils.MetricFamily; `keep_family(f)` keeps each family alive as long as its metrics."""
        self.bounds = list(bounds)
        self.per_bucket = [0] * (len(bounds) + 1)  # not cumulative; the last is (largest bound, +Inf)
        self.sum = 0.0
        self.published_cumulative = [0] * (len(bounds) + 1)
        self.published_sum = 0.0

        def counter_family(suffix: str, desc: str):
            fam = family(name=f"{name}_{suffix}", description=desc, kind=family.COUNTER)
            keep_family(fam)
            return fam

        buckets = counter_family("bucket", f"{description} (cumulative count per upper bound le)")
        self.bucket_series = [buckets.Metric(labels={**labels, "le": bound_label(b)})
                              for b in [*self.bounds, math.inf]]
        self.sum_series = counter_family("sum", f"{description} (sum of the values)").Metric(labels=labels)
        self.count_series = counter_family("count", f"{description} (number of values)").Metric(labels=labels)

    def observe(self, value: float) -> None:
        """Bin one value (no call into Triton): it counts in every bucket whose bound is >= it."""
        self.per_bucket[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def publish(self) -> None:
        """Move each series that changed since the last publish by what is new."""
        cumulative, running = [], 0
        for n in self.per_bucket:
            running += n
            cumulative.append(running)
        for series, now, before in zip(self.bucket_series, cumulative, self.published_cumulative):
            if now > before:
                series.increment(now - before)
        if cumulative[-1] > self.published_cumulative[-1]:
            self.count_series.increment(cumulative[-1] - self.published_cumulative[-1])
            if self.sum > self.published_sum:
                self.sum_series.increment(self.sum - self.published_sum)
            self.published_sum = self.sum
        self.published_cumulative = cumulative
