"""The adapters an engine knows: declared ones (`LoRAConfig.lora_modules`) by name and id, and those a request
brings (an offline LoRARequest). `resolve` turns what a request names into its LoRARequest, and checks an
adapter's files against the model the first time it is used, on the caller's thread (a front end's): a
malformed adapter is refused with its request, before anything is queued."""

from __future__ import annotations

import threading

from pagedllm.config import LoRAConfig
from pagedllm.lora_request import LoRARequest
from pagedllm.models.lora.adapter import load_peft_adapter


class LoRARegistry:
    def __init__(self, config: LoRAConfig, hf_config) -> None:
        self.config, self.hf_config = config, hf_config
        self.by_name = {name: LoRARequest(name, lora_id, path) for name, path, lora_id in config.lora_modules}
        self.by_id = {r.lora_int_id: r for r in self.by_name.values()}
        self.checked: dict[int, LoRARequest] = {}  # ids whose files were read and fit the model
        self.lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def resolve(self, lora) -> LoRARequest | None:
        """`lora`: None, a LoRARequest, a declared adapter's name (lora_name) or id (lora_task_id).
        ValueError naming the problem (and the field the request used)."""
        if lora is None:
            return None
        field = {str: "lora_name", int: "lora_task_id"}.get(type(lora), "lora_request")
        if not self.config.enable_lora:
            raise ValueError(f"{field}: this engine serves no LoRA adapters (start it with enable_lora)")
        if isinstance(lora, LoRARequest):
            known = self.by_id.get(lora.lora_int_id) or self.checked.get(lora.lora_int_id)
            if known is not None and (known.lora_path, known.lora_name) != (lora.lora_path, lora.lora_name):
                raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} already names adapter "
                                 f"{known.lora_name!r} at {known.lora_path}")
            request = lora
        elif isinstance(lora, str):
            request = self.by_name.get(lora)
            if request is None:
                raise ValueError(f"lora_name: unknown adapter {lora!r} (known: {', '.join(self.names()) or 'none'})")
        elif isinstance(lora, int) and not isinstance(lora, bool):
            request = self.by_id.get(lora)
            if request is None:
                raise ValueError(f"lora_task_id: unknown adapter id {lora} (known: "
                                 f"{', '.join(str(i) for i in sorted(self.by_id)) or 'none'})")
        else:
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora).__name__}")
        self.check(request)
        return request

    def check(self, request: LoRARequest) -> None:
        """Read the adapter once and check it fits the model; ValueError otherwise."""
        with self.lock:
            if request.lora_int_id in self.checked:
                return
            load_peft_adapter(request.lora_path, self.hf_config, self.config.max_lora_rank)
            self.checked[request.lora_int_id] = request

    def check_declared(self) -> None:
        """At start: every declared adapter is readable and fits (a broken one fails the start, naming it)."""
        for request in self.by_name.values():
            self.check(request)
