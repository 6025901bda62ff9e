"""Per-request and per-step measurements for exporters (Prometheus through Triton, offline summaries).

The engine only appends (name, value) pairs to a deque: cheap, and safe to drain from another thread.
Nothing is recorded until an exporter asks for it (`LLMEngine.enable_observations`).
"""

from __future__ import annotations

from collections import deque

from pagedllm.engine.request import Request

# Histogram names, as in vLLM (exported as pagedllm:<name>).
TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
E2E = "e2e_request_latency_seconds"
QUEUE = "request_queue_time_seconds"
PREFILL = "request_prefill_time_seconds"
DECODE = "request_decode_time_seconds"
PROMPT_TOKENS = "request_prompt_tokens"
GENERATION_TOKENS = "request_generation_tokens"
ITERATION_TOKENS = "iteration_tokens"


class Observations:
    def __init__(self, maxlen: int = 1_000_000) -> None:
        # Bounded, so an exporter that stops draining costs memory, not a crash; oldest entries go first.
        self.items: deque[tuple[str, float]] = deque(maxlen=maxlen)

    def add(self, name: str, value: float) -> None:
        self.items.append((name, value))

    def drain(self) -> list[tuple[str, float]]:
        out = []
        while True:
            try:
                out.append(self.items.popleft())
            except IndexError:
                return out

    def request_finished(self, req: Request) -> None:
        """Request-level timings (only the phases the request reached) and token counts."""
        end = req.finished_time
        self.add(E2E, end - req.arrival_time)
        self.add(PROMPT_TOKENS, req.num_prompt_tokens)
        self.add(GENERATION_TOKENS, req.num_output_tokens)
        if req.first_scheduled_time is not None:
            self.add(QUEUE, req.first_scheduled_time - req.arrival_time)
            if req.first_token_time is not None:
                self.add(PREFILL, req.first_token_time - req.first_scheduled_time)
                self.add(DECODE, end - req.first_token_time)
