"""Paged attention on AVX-512 CPUs: the C++ kernel beside this file, its launcher, and a torch reference.

Each row is a sequence with its block table and context length, and its last tokens are the queries (one for a
decode; a whole prompt, or a chunk after cached positions): token i of a row's n sees the context's first
len - (n - 1 - i) positions. Without `query_start_loc` every row is one token. The kernel reads K/V in place
through the block table, in the layout kv_layout.py describes (the torch path gathers them into a padded copy
first), and serves the query heads of a KV head, for a tile of a prompt's tokens, from one pass over that KV
head's run in each block. It is compiled on first use into torch's extension cache (see build.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm_kernels.cpu.build import amx_supported, cpu_supported, extension

__all__ = ["amx_supported", "cpu_supported", "load_kernel", "paged_attention", "reference"]


def load_kernel() -> None:
    """Compile (or load the cached build of) the kernel; raises RuntimeError with the reason when it cannot."""
    extension()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, window: int | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, query_start_loc: torch.Tensor | None = None, amx: bool = False) -> torch.Tensor:
    """q [tokens, H, D]; caches [blocks, block_size, KVH, D] in the kernels' layout (kv_layout.py), of q's dtype
    or float8_e4m3fn (with a bf16 q; values = elements * k_scale / v_scale); block_tables [rows, >=
    ceil(len/bs)] int64; seq_lens [rows] int64 (the context, this step's tokens included); query_start_loc
    [rows + 1]: where each row's tokens start in q (default: one token per row). `amx`: prompts' tiles, and
    decodes with 5 or more query heads per KV head, on the AMX tile unit (attention_amx.h; a bf16 q and block
    sizes 16, 32 or 64, else it has no effect; refused where the CPU has no AMX, see amx_supported()). Returns
    [tokens, H, D] in q's dtype."""
    if q.device.type != "cpu":
        raise ValueError("paged_attention is a CPU kernel")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"shapes: q {tuple(q.shape)}, caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k_cache.shape[2]} KV heads")
    rows = seq_lens.shape[0]
    if query_start_loc is None:
        query_start_loc = torch.arange(rows + 1)
    if block_tables.shape[0] != rows or seq_lens.shape != (rows,) or query_start_loc.shape != (rows + 1,):
        raise ValueError("one block table row, one length and one query start per row (and the end)")
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    return extension().paged_attention(q, k_cache, v_cache, block_tables.long(), seq_lens.long().contiguous(),
                                       query_start_loc.long().contiguous(), float(scale), window or 0,
                                       float(k_scale), float(v_scale), bool(amx))


def per_token_rows(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor):
    """The same queries as one row per token: each token's row's block table and its own context length."""
    starts = query_start_loc.long()
    counts = starts.diff()
    row_of_token = torch.repeat_interleave(torch.arange(seq_lens.shape[0]), counts)
    after = starts[1:][row_of_token] - 1 - torch.arange(int(starts[-1]))  # the row's tokens after this one
    return block_tables[row_of_token], seq_lens.long()[row_of_token] - after


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale, window=None, k_scale=1.0,
              v_scale=1.0, query_start_loc=None) -> torch.Tensor:
    """Token by token: gather its row's blocks, attend with SDPA in fp32. Caches in the plain layout."""
    if query_start_loc is not None:
        block_tables, seq_lens = per_token_rows(block_tables, seq_lens, query_start_loc)
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        n = int(seq_lens[r])
        blocks = block_tables[r, :-(-n // bs)]
        k = k_cache[blocks].flatten(0, 1)[:n].float() * k_scale
        v = v_cache[blocks].flatten(0, 1)[:n].float() * v_scale
        first = max(0, n - window) if window else 0
        k, v = k[first:], v[first:]
        o = F.scaled_dot_product_attention(q[r, :, None].float(), k.transpose(0, 1), v.transpose(0, 1),
                                           scale=scale, enable_gqa=True)
        out[r] = o[:, 0].to(q.dtype)
    return out
