"""Kernels for pagedllm, each beside its torch reference.

- `paged_attention`, `kv_store`: Triton-lang kernels. On a machine without a GPU they run under Triton's
  interpreter (`TRITON_INTERPRET=1`, set before triton is imported), which the tests use.
- `cpu/`: C++ AVX-512 / AMX kernels, compiled on first use (see cpu/build.py).

Nothing is imported here: a caller of the CPU kernels never pays for importing Triton, and the other way round.
"""
