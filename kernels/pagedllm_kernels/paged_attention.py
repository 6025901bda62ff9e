"""Paged attention for a mixed batch: decode rows (1 query), prefill and chunked-prefill rows (any length),
and rows whose context starts in shared prefix-cache blocks, all read through the block table. Causal, GQA,
optional sliding window, online softmax in fp32.

Each program takes one (sequence, KV head, tile of queries) and puts the tile's queries *and* the query heads
sharing that KV head into the rows of one matrix, so a decode row still fills a 16-row tl.dot.

An fp8 (float8_e4m3fn) cache is read as bytes and widened in the kernel by bit moves (e4m3 into fp16's fields,
exact, subnormals included), so it needs no fp8 hardware and runs under the interpreter; its values are the
elements times k_scale / v_scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm_kernels.e4m3 import e4m3_to_f32

FP8 = torch.float8_e4m3fn


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, window, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr, FP8_CACHE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + r // GROUP  # query within the sequence
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx  # absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = ctx - q_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)  # keys after the tile's last query: masked
    first_block = 0
    if USE_WINDOW:
        first_block = tl.maximum(ctx - q_len + tile * BLOCK_Q - window + 1, 0) // BLOCK_SIZE
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(first_block, tl.cdiv(end, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
        kv_off = block_id * stride_cb + offs[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        if FP8_CACHE:  # the elements as they are (exact in tf32); the scales are folded in outside the loop
            k = e4m3_to_f32(tl.load(k_cache_ptr + kv_off, mask=d_ok[None, :], other=0))
            v = e4m3_to_f32(tl.load(v_cache_ptr + kv_off, mask=d_ok[None, :], other=0))
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=d_ok[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + kv_off, mask=d_ok[None, :], other=0.0).to(tl.float32)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        k_pos = b * BLOCK_SIZE + offs
        ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx) & row_ok[:, None]
        if USE_WINDOW:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m_i - base)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(o_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("caches must be [blocks, block_size, kv_heads, head_dim], both the same shape")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (heads % kv_heads)")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8):
        raise ValueError("the caches must share q's dtype, or both be float8_e4m3fn")
    bs = k_cache.shape[1]
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {bs}")
    rows = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or query_start_loc.shape != (rows + 1,):
        raise ValueError("block_tables [rows, max_blocks], seq_lens [rows], query_start_loc [rows + 1] disagree")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head_dim axis must be contiguous")
    if k_cache.stride() != v_cache.stride() or block_tables.stride(1) != 1:
        raise ValueError("caches must share strides; block_tables rows must be contiguous")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                    sliding_window: int | None = None, out: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """q [T, H, D]; caches [blocks, block_size, KVH, D] of q's dtype or float8_e4m3fn (values = elements *
    k_scale / v_scale); row i's queries are q[query_start_loc[i]:...[i+1]], the last ones of its seq_lens[i]
    tokens of context. Returns [T, H, D]."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    fp8 = k_cache.dtype == FP8
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    out = torch.empty_like(q) if out is None else out
    rows, kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if rows == 0 or q.shape[0] == 0:
        return out
    group = q.shape[1] // kv_heads
    block_q = max(1, 16 // group)
    grid = (rows, kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale * (k_scale if fp8 else 1.0),
        sliding_window or 0, float(v_scale) if fp8 else 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
        HEAD_DIM=q.shape[2], BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])), BLOCK_SIZE=k_cache.shape[1],
        USE_WINDOW=sliding_window is not None, FP32_DOT=q.dtype == torch.float32, FP8_CACHE=fp8)
    return out


def reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                              sliding_window=None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """Plain torch, one sequence at a time, fp32 math: the oracle for the kernel."""
    out = torch.empty_like(q)
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    for i in range(seq_lens.shape[0]):
        s, e, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        if e == s:
            continue
        blocks = block_tables[i, : -(-ctx // bs)].long()
        keys = (k_cache[blocks].reshape(-1, kvh, q.shape[2])[:ctx].float() * k_scale).repeat_interleave(group, 1)
        vals = (v_cache[blocks].reshape(-1, kvh, q.shape[2])[:ctx].float() * v_scale).repeat_interleave(group, 1)
        qs = q[s:e].float()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        qpos = torch.arange(ctx - (e - s), ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        ok = kpos <= qpos
        if sliding_window is not None:
            ok &= kpos > qpos - sliding_window
        probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
    return out
