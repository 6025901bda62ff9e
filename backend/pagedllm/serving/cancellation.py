"""Which in-flight requests the response thread asks, in one sweep, whether their client has cancelled.

Each ask is an IPC round trip to tritonserver, so a sweep asks only a share of them: as many as keeps every
request asked at least once per `period_s` of wall time, the longest unasked first. The share follows the time
since the previous sweep, not a fixed count: a response thread that falls behind (a storm of streams on a fast
model) sweeps late and then asks more. With a fixed count per sweep, a cancellation storm on a 2-core Zen 5
host left 3-15 of 100 disconnected streams unasked until they had run to their 1,000 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Hashable


def due_for_asking(last_asked: dict[Hashable, float], since_last_sweep_s: float, period_s: float) -> list:
    """The keys of `last_asked` (key -> when it was last asked, or registered) to ask now, oldest first."""
    share = math.ceil(len(last_asked) * min(1.0, since_last_sweep_s / period_s))
    return sorted(last_asked, key=last_asked.__getitem__)[:share]
