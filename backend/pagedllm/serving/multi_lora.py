"""The model directory's adapters: engine.json's `lora_modules` and vllm_backend's `multi_lora.json` beside it
({"adapter name": "adapter directory"}), merged into one `lora_modules` list. Relative paths are relative to
the version directory; adapters of multi_lora.json get the ids after engine.json's, in file order (the ids
lora_task_id names)."""

from __future__ import annotations

import json
import os

from pagedllm.config import LoRAConfig

MULTI_LORA_FILE = "multi_lora.json"


def with_multi_lora(args: dict, version_dir: str) -> dict:
    """`args` (engine.json's entries) with every declared adapter in `lora_modules`; ValueError naming the file
    for a malformed declaration."""
    declared = list(LoRAConfig(enable_lora=True, lora_modules=args.get("lora_modules", ())).lora_modules)
    path = os.path.join(version_dir, MULTI_LORA_FILE)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                extra = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot be read: {e}") from None
        if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
            raise ValueError(f"{path}: expected an object mapping adapter names to directories")
        next_id = max((lora_id for _, _, lora_id in declared), default=0) + 1
        declared += [(name, adapter, next_id + i) for i, (name, adapter) in enumerate(extra.items())]
    if not declared:
        return args
    resolved = [{"name": name, "path": p if os.path.isabs(p) else os.path.normpath(os.path.join(version_dir, p)),
                 "id": lora_id} for name, p, lora_id in declared]
    LoRAConfig(enable_lora=True, lora_modules=resolved)  # names and ids unique across both files
    return {**args, "lora_modules": resolved}
