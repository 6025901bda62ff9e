"""Start-up progress: each phase of an engine's start is logged as it begins, and its time is kept for the
"engine ready" line, so a slow start says where its time went (and a hung one, where it hangs)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

logger = logging.getLogger("pagedllm.engine.engine")


class StartupPhases:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}  # phase -> seconds, in the order they ran

    @contextmanager
    def phase(self, name: str, detail: str = ""):
        logger.info("engine start: %s%s ...", name, f" ({detail})" if detail else "")
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - start

    def summary(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"{time.monotonic() - self.started:.1f} s ({parts})"
