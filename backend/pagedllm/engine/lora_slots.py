"""Rank 0's map of the `max_loras` adapter slots: which adapter each holds, reused least recently used first.

Before a step runs, every adapter its rows use is placed: one already resident is touched, another takes a free
slot or evicts the least recently used adapter that this step does not use. The loads ride in the step's
inputs, so every tensor-parallel rank fills the same slot (from its own host-memory copy, or the disk). The
scheduler admits no more distinct adapters than there are slots, so a step's adapters always fit.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.lora_request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0  # adapters put in a slot (first use, and again after an eviction)

    def place(self, loras: list[LoRARequest | None]) -> list[tuple[int, int, str]]:
        """Make every adapter in `loras` resident; returns the loads that needs, (slot, id, path)."""
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters, more than max_loras={self.max_loras}")
        loads = []
        for lora_id, lora in wanted.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            if self.free:
                slot = self.free.pop()
            else:
                victim = next(i for i in self.slot_of if i not in wanted)
                slot = self.slot_of.pop(victim)
            self.slot_of[lora_id] = slot
            loads.append((slot, lora_id, lora.lora_path))
        self.num_loads += len(loads)
        return loads

    def slot(self, lora: LoRARequest | None) -> int:
        return -1 if lora is None else self.slot_of[lora.lora_int_id]
