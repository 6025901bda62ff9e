"""Triton-lang kernels for pagedllm, each beside its torch reference.

On a machine without a GPU they run under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
imported), which the tests use; the engine's selector only keeps them where they measure fastest.
"""

from pagedllm_kernels.kv_store import kv_store, reference_kv_store
from pagedllm_kernels.paged_attention import paged_attention, reference_paged_attention

__all__ = ["kv_store", "reference_kv_store", "paged_attention", "reference_paged_attention"]
