"""A small client for a pagedllm model served by Triton. Speaks only HTTP/gRPC (tritonclient); imports
nothing from the engine."""

from pagedllm_client.client import GenerateResult, PagedLLMClient

__all__ = ["PagedLLMClient", "GenerateResult"]
