"""The AVX2 kernels (pagedllm_kernels/cpu/avx2/) against torch references at block-boundary shapes. They run on
any CPU with AVX2, FMA and F16C, AVX-512 ones included, so every x86 test host checks them."""

import pytest
import torch
from e4m3_edges import EDGE_FREE_TOKEN, kv_with_edges

from pagedllm_kernels.cpu import avx2_attention, avx2_linear
from pagedllm_kernels.kv_store import reference_kv_store

pytestmark = pytest.mark.skipif(not avx2_linear.avx2_supported()[0], reason=avx2_linear.avx2_supported()[1])


def test_tiles_round_trip_and_refuse_what_they_cannot_hold():
    w = torch.randn(24, 37).to(torch.bfloat16)
    tiles = avx2_linear.pack(w)
    assert tiles.shape == (3, 37, 8) and torch.equal(avx2_linear.unpack(tiles), w)
    assert not avx2_linear.can_pack(torch.randn(20, 16).to(torch.bfloat16))  # 20 columns: not whole tiles
    with pytest.raises(ValueError, match="N % 8"):
        avx2_linear.pack(torch.randn(16, 16))  # fp32


# rows: every register block (6) and its tails, several blocks; N: an odd number of tiles (the single-tile tail)
# and pairs; K: odd (the interleaved runs' tail) and the 125M model's.
@pytest.mark.parametrize("n,k", [(8, 1), (24, 37), (16, 3), (40, 768), (64, 130)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12, 13, 64])
def test_bf16_linear_matches_the_fp32_reference(n, k, rows):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    tiles = avx2_linear.pack(w)
    for b in (None, bias):
        y = avx2_linear.linear(x, tiles, b)
        exact = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # fp32 sums rounded once to bf16: within one bf16 rounding (2^-8 relative) of the exact result
        torch.testing.assert_close(y.double(), exact, rtol=2 ** -8, atol=1e-5 * k)


def test_bf16_linear_reads_a_strided_x():
    w = torch.randn(32, 64).to(torch.bfloat16)
    wide = torch.randn(5, 128).to(torch.bfloat16)
    x = wide[:, 32:96]  # rows 128 apart
    tiles = avx2_linear.pack(w)
    assert torch.equal(avx2_linear.linear(x, tiles), avx2_linear.linear(x.contiguous(), tiles))


def _reference_decode(q, kc, vc, tables, lens, scale, window):
    out = []
    for i in range(q.shape[0]):
        n, bs = int(lens[i]), kc.shape[1]
        pos = torch.arange(n)
        k, v = kc[tables[i, pos // bs], pos % bs].double(), vc[tables[i, pos // bs], pos % bs].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        if window:
            s[:, :max(0, n - window)] = float("-inf")
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
    return torch.stack(out)


# (heads, KV heads, head dim, block size): MHA, GQA 7:1 (Qwen2-0.5B), 4:1 with D=128, MQA with D=8
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(12, 12, 64, 16), (14, 2, 64, 16), (8, 2, 128, 32), (4, 1, 8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6, 40])
def test_decode_attention_matches_the_reference(heads, kv_heads, d, bs, dtype, window):
    g = torch.Generator().manual_seed(heads + d + bs)
    blocks = 64
    kc, vc = (torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    # 1 token, inside a block, one past a block, a whole number of blocks, across many blocks
    lens = torch.tensor([1, 5, bs + 1, 2 * bs, 100, 7, 8 * bs])
    tables = torch.stack([torch.randperm(blocks - 1, generator=g)[:10] + 1 for _ in lens])
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = avx2_attention.decode_attention(q, kc, vc, tables, lens, d ** -0.5, window)
    ref = _reference_decode(q, kc, vc, tables, lens, d ** -0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# Fewer work items (row, KV head) than threads, as many, and more: 1-3 rows, 1-4 threads, 1-5 KV heads.
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(12, 4), (15, 5), (14, 2), (4, 1)])
def test_decode_attention_with_few_rows_and_any_thread_count(rows, threads, heads, kv_heads):
    g = torch.Generator().manual_seed(rows * 10 + kv_heads)
    d, bs, blocks = 16, 16, 32
    kc, vc = (torch.randn(blocks, bs, kv_heads, d, generator=g) for _ in range(2))
    lens = torch.tensor([37, 3, 70][:rows])
    tables = torch.stack([torch.randperm(blocks - 1, generator=g)[:5] + 1 for _ in lens])
    q = torch.randn(rows, heads, d, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = avx2_attention.decode_attention(q, kc, vc, tables, lens, d ** -0.5, None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), _reference_decode(q, kc, vc, tables, lens, d ** -0.5, None),
                               atol=1e-5, rtol=1e-5)


def test_decode_attention_refuses_what_it_cannot_read():
    q = torch.randn(2, 4, 12)  # head dim 12: not a multiple of 8
    cache = torch.randn(4, 16, 2, 12)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        avx2_attention.decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.long),
                                        torch.ones(2, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="the caches q.s dtype"):
        avx2_attention.decode_attention(torch.randn(2, 4, 16).to(torch.bfloat16), torch.randn(4, 16, 2, 16),
                                        torch.randn(4, 16, 2, 16), torch.zeros(2, 1, dtype=torch.long),
                                        torch.ones(2, dtype=torch.long), 1.0)


# The fp8 cache: e4m3 elements with per-tensor K and V scales, q and the output in bf16 or fp32.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.3, 0.7)])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_attention_reads_an_fp8_cache(dtype, k_scale, v_scale, window):
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d, bs, blocks = 14, 2, 64, 16, 32
    kc, vc = ((torch.randn(blocks, bs, kv_heads, d, generator=g) * 3 / s).to(torch.float8_e4m3fn)
              for s in (k_scale, v_scale))
    kc.view(torch.uint8)[1, 0, 0, :8] = torch.arange(8, dtype=torch.uint8)  # subnormals, in a row's first block
    lens = torch.tensor([1, bs + 1, 100, 7])
    tables = torch.stack([torch.randperm(blocks - 1, generator=g)[:8] + 1 for _ in lens])
    tables[0, 0] = 1
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = avx2_attention.decode_attention(q, kc, vc, tables, lens, d ** -0.5, window, k_scale, v_scale)
    ref = _reference_decode(q, kc.double() * k_scale, vc.double() * v_scale, tables, lens, d ** -0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.125, 7.5), (0.3, 3.0)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_fp8_writes_torchs_codes(dtype, k_scale, v_scale, slot_dtype):
    """Byte for byte torch's float8 conversion of value / scale at every rounding edge (each e4m3 value, each
    midpoint and one ulp either side, subnormals, the clamp at 448, negatives) and on random K/V read through
    strided heads (K and V are views of one fused qkv row, as the model makes them); padding skipped."""
    heads, d, tokens = 2, 32, 40
    k, v = kv_with_edges(tokens, heads, d, k_scale, v_scale, dtype)
    qkv = torch.cat([torch.zeros(tokens, 4, d, dtype=dtype), k, v], dim=1)  # q, k, v heads side by side
    k, v = qkv[:, 4:6], qkv[:, 6:]
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(8 * 16, generator=g)[:tokens].to(slot_dtype)
    slots[EDGE_FREE_TOKEN] = -1  # padding: left as it was
    kc = torch.zeros(8, 16, heads, d, dtype=torch.uint8).view(torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    avx2_attention.store_kv_fp8(k, v, kc, vc, slots, k_scale, v_scale)
    reference_kv_store(k, v, kc_ref, vc_ref, slots, k_scale, v_scale)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    assert kc.view(torch.uint8).count_nonzero() > 0.9 * (tokens - 1) * heads * d


def test_store_kv_fp8_refuses_what_it_cannot_write():
    k = torch.randn(2, 1, 16)
    kc = torch.zeros(2, 16, 1, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        avx2_attention.store_kv_fp8(k, k, kc.float(), kc.float(), slots)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        avx2_attention.store_kv_fp8(k[..., :12], k[..., :12], kc[..., :12], kc[..., :12], slots)
    with pytest.raises(RuntimeError, match="slots"):
        avx2_attention.store_kv_fp8(k, k, kc, kc, slots[:1])
