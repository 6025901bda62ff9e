"""The periodic one-line engine log (like vLLM's): throughput since the last line, queue and KV state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagedllm.engine.stats import EngineStats

logger = logging.getLogger("pagedllm.stats")


class StatLogger:
    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.last_time = time.monotonic()
        self.last_prompt = 0
        self.last_generation = 0

    def maybe_log(self, get_stats: Callable[[], EngineStats]) -> str | None:
        now = time.monotonic()
        elapsed = now - self.last_time
        if elapsed < self.interval_s:
            return None
        stats = get_stats()
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        line = (f"Avg prompt throughput: {(stats.prompt_tokens - self.last_prompt) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(stats.generation_tokens - self.last_generation) / elapsed:.1f} "
                f"tokens/s, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%, "
                f"Preemptions: {stats.num_preemptions}")
        self.last_time, self.last_prompt, self.last_generation = now, stats.prompt_tokens, stats.generation_tokens
        logger.info(line)
        return line
