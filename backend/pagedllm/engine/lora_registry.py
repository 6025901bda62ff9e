"""The adapters an engine knows: declared ones (`LoRAConfig.lora_modules`) by name and id, and those a request
brings (an offline LoRARequest). `resolve` turns what a request names into its LoRARequest and the adapter's
weights, read and checked against the model the first time on the caller's thread (a front end's): a
malformed adapter is refused with its request, before anything is queued.

The weights read are kept in host memory, least recently used dropped past `max_cpu_loras`, and each request
carries them into the engine: no step reads an adapter's files, and an adapter stays in memory while any
request holds it, whatever the cache dropped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pagedllm.config import LoRAConfig
from pagedllm.lora_request import LoRARequest
from pagedllm.models.lora.adapter import LoRAAdapter, load_peft_adapter


class LoRARegistry:
    def __init__(self, config: LoRAConfig, hf_config) -> None:
        self.config, self.hf_config = config, hf_config
        self.by_name = {name: LoRARequest(name, lora_id, path) for name, path, lora_id in config.lora_modules}
        self.by_id = {r.lora_int_id: r for r in self.by_name.values()}  # the declared ones (lora_task_id)
        self.known = dict(self.by_id)  # id -> the adapter it names, declared or brought, for good
        self.cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host copies, least recently used first
        self.lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def resolve(self, lora) -> tuple[LoRARequest | None, LoRAAdapter | None]:
        """`lora`: None, a LoRARequest, a declared adapter's name (lora_name) or id (lora_task_id) -> the
        LoRARequest and its weights. ValueError naming the problem (and the field the request used)."""
        if lora is None:
            return None, None
        field = {str: "lora_name", int: "lora_task_id"}.get(type(lora), "lora_request")
        if not self.config.enable_lora:
            raise ValueError(f"{field}: this engine serves no LoRA adapters (start it with enable_lora)")
        if isinstance(lora, LoRARequest):
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
        return request, self.load(request)

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter's weights, from host memory or read and checked now; ValueError if they do not fit, or if
        its id already names another adapter."""
        with self.lock:
            known = self.known.get(request.lora_int_id)
            if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
                raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} already names adapter "
                                 f"{known.lora_name!r} at {known.lora_path}")
            adapter = self.cache.get(request.lora_int_id)
            if adapter is None:
                adapter = load_peft_adapter(request.lora_path, self.hf_config, self.config.max_lora_rank)
                self.cache[request.lora_int_id] = adapter
                self.known[request.lora_int_id] = request
            self.cache.move_to_end(request.lora_int_id)
            limit = self.config.max_cpu_loras
            while limit is not None and len(self.cache) > limit:
                self.cache.popitem(last=False)
            return adapter

    def check_declared(self) -> None:
        """At start: every declared adapter is readable and fits (a broken one fails the start, naming it)."""
        for request in self.by_name.values():
            self.load(request)
