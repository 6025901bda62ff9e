"""Model families and their registry."""

from pagedllm.models.registry import register_model, resolve_model_class, supported_architectures

__all__ = ["register_model", "resolve_model_class", "supported_architectures"]
