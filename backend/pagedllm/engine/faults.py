"""Test-only fault injection (`EngineConfig.fault_injection`): raise at one point of the engine for requests whose
prompt holds a trigger token, so that tests can show a failure costs exactly what it should (one request, or,
for the forward pass, the engine until it restarts). Without the setting the engine holds no injector."""

from __future__ import annotations

from pagedllm.config import FaultInjection
from pagedllm.engine.request import Request


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, spec: FaultInjection) -> None:
        self.spec = spec

    def check(self, point: str, reqs: list[Request]) -> None:
        if point == self.spec.point and any(self.spec.token_id in r.prompt_token_ids for r in reqs):
            raise InjectedFault(f"injected {point} fault")
