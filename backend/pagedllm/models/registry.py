"""Model registry keyed by config.json `architectures[0]`.

In-tree families are registered here; out-of-tree ones call `register_model` or declare an entry point in
the `pagedllm.models` group (name = architecture, value = "module:Class"), loaded on first lookup.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from pagedllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM

_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
_entry_points_loaded = False


class UnsupportedArchitectureError(ValueError):
    pass


def register_model(architecture: str, model_cls: type) -> None:
    _REGISTRY[architecture] = model_cls


def supported_architectures() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def resolve_model_class(config, model_impl: str = "auto") -> type:
    """`model_impl` (EngineConfig's): "auto", "pagedllm" (no fallback) or "transformers" (always the fallback)."""
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise UnsupportedArchitectureError(
            f"config.json has no 'architectures'; supported: {', '.join(supported_architectures())}")
    _load_entry_points()
    arch = archs[0]
    if arch in _REGISTRY and model_impl != "transformers":
        return _REGISTRY[arch]
    if arch.endswith("ForCausalLM") and _transformers_knows(config) and model_impl != "pagedllm":
        from pagedllm.models.transformers_fallback import TransformersForCausalLM

        return TransformersForCausalLM
    raise UnsupportedArchitectureError(
        f"architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}, and any "
        "*ForCausalLM transformers has (the fallback) (register more with pagedllm.models.register_model or the "
        "'pagedllm.models' entry-point group)")


def _transformers_knows(config) -> bool:
    """transformers has the class config.architectures[0] names (the fallback builds it)."""
    import transformers

    return isinstance(getattr(transformers, config.architectures[0], None), type)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="pagedllm.models"):
        _REGISTRY.setdefault(ep.name, ep.load())
