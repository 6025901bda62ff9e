"""Rank 0's map of the `max_loras` adapter slots: which adapter each holds, reused least recently used first.

Before a step runs, every adapter its rows use is placed: one already resident is touched, another takes a free
slot or evicts the least recently used adapter that this step does not use (one no running request uses, if
there is one). The loads carry the adapters' weights in the step's inputs, so every tensor-parallel rank fills
the same slot from them (no rank reads a file during a step). The scheduler admits no more distinct adapters
than there are slots, so a step's adapters always fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class LoRASlots:
    def __init__(self, max_loras: int, busy: Callable[[], set[int]] = set) -> None:
        """`busy`: the adapter ids running requests use (evicted last)."""
        self.max_loras = max_loras
        self.busy = busy
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0  # adapters put in a slot (first use, and again after an eviction)

    def place(self, requests) -> list[tuple[int, int, object]]:
        """Make the adapter of every request (a Request: `lora`, `lora_weights`) resident; returns the loads that
        needs, (slot, id, weights)."""
        wanted = {r.lora.lora_int_id: r.lora_weights for r in requests if r.lora is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters, more than max_loras={self.max_loras}")
        loads, busy = [], None
        for lora_id, weights in wanted.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            if self.free:
                slot = self.free.pop()
            else:
                busy = self.busy() if busy is None else busy
                idle = [i for i in self.slot_of if i not in wanted]
                victim = next((i for i in idle if i not in busy), idle[0])
                slot = self.slot_of.pop(victim)
            self.slot_of[lora_id] = slot
            loads.append((slot, lora_id, weights))
        self.num_loads += len(loads)
        return loads

    def slot(self, lora) -> int:
        return -1 if lora is None else self.slot_of[lora.lora_int_id]
