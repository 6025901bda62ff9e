"""Triton kernels against their torch references (under TRITON_INTERPRET=1 on CPU, natively on a GPU):
decode, prefill, chunked prefill, prefix hits, shuffled block tables, block-boundary lengths, GQA ratios,
sliding window, fp32 and bf16, slot -1 padding."""

import pytest
import torch
from e4m3_edges import EDGE_FREE_TOKEN, kv_with_edges

from pagedllm_kernels.kv_store import kv_store, reference_kv_store
from pagedllm_kernels.paged_attention import paged_attention, reference_paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 16
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}

# (query_len, context_len) per row: decodes at and around block boundaries, a full prefill, chunked
# prefills, and a row whose first two blocks are shared with row 0 (a prefix hit).
ROWS = [(1, 1), (1, 16), (1, 17), (1, 40), (33, 33), (7, 40), (16, 48), (10, 42)]


def make_batch(heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    max_blocks = max(-(-ctx // BS) for _, ctx in ROWS)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # shuffled, never the null block 0
    tables, used = torch.zeros(len(ROWS), max_blocks, dtype=torch.int32), 0
    for i, (_, ctx) in enumerate(ROWS):
        n = -(-ctx // BS)
        tables[i, :n] = perm[used:used + n]
        used += n
    tables[7, :2] = tables[3, :2]  # prefix hit: row 7 starts in row 3's blocks
    q_lens = [q for q, _ in ROWS]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    seq_lens = torch.tensor([c for _, c in ROWS], dtype=torch.int32)
    return q, k_cache, v_cache, tables.to(DEVICE), seq_lens.to(DEVICE), qsl.to(DEVICE), max(q_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2), (12, 4)])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_matches_reference(dtype, heads, kv_heads, window):
    q, kc, vc, bt, sl, qsl, max_q = make_batch(heads, kv_heads, 32, dtype)
    scale = 32 ** -0.5
    got = paged_attention(q, kc, vc, bt, sl, qsl, max_q, scale, window)
    want = reference_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), scale, window)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_attention_head_dim_64_and_int64_tables():
    q, kc, vc, bt, sl, qsl, max_q = make_batch(8, 4, 64, torch.float32, seed=3)
    got = paged_attention(q, kc, vc, bt.long(), sl.long(), qsl.long(), max_q, 0.125)
    want = reference_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), 0.125)
    torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=2e-4)


def test_paged_attention_launcher_rejects_bad_shapes():
    q, kc, vc, bt, sl, qsl, max_q = make_batch(4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="heads"):
        paged_attention(q[:, :3], kc, vc, bt, sl, qsl, max_q, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.to(torch.bfloat16), kc, vc, bt, sl, qsl, max_q, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(q, kc.transpose(1, 3).contiguous().transpose(1, 3), vc, bt, sl, qsl, max_q, 1.0)
    with pytest.raises(ValueError, match="disagree"):
        paged_attention(q, kc, vc, bt, sl[:-1], qsl, max_q, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_store_writes_slots_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(8, BS, 2, 32, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(8, BS, 2, 32, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(6, 2, 32, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(6, 2, 32, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([17, -1, 0, 127, -1, 40], device=DEVICE)  # block boundaries, shuffled, padding
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_store(k, v, kc, vc, slots)
    reference_kv_store(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.equal(kc.view(-1, 2, 32)[17], k[0]) and torch.equal(vc.view(-1, 2, 32)[127], v[3])
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_store(k, v, kc, vc, slots[:3])


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, window", [(4, 4, None), (12, 4, None), (8, 2, 20)])
def test_paged_attention_over_an_fp8_cache(dtype, heads, kv_heads, window):
    """The kernel widens e4m3 bytes itself: it must read exactly torch's float8 values, times the scales."""
    q, kc, vc, bt, sl, qsl, max_q = make_batch(heads, kv_heads, 32, dtype, seed=5)
    kc8, vc8 = (kc.float() / 0.25).to(FP8), (vc.float() * 2).clamp(-448, 448).to(FP8)
    got = paged_attention(q, kc8, vc8, bt, sl, qsl, max_q, 32 ** -0.5, window, k_scale=0.25, v_scale=0.5)
    want = reference_paged_attention(q.cpu(), kc8.cpu(), vc8.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), 32 ** -0.5,
                                     window, k_scale=0.25, v_scale=0.5)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.125, 7.5), (0.3, 3.0)])
def test_kv_store_into_an_fp8_cache_writes_torchs_codes(dtype, k_scale, v_scale):
    """The kernel's own e4m3 rounding equals torch's float8 conversion of value / scale, byte for byte, at every
    rounding edge (ties, one ulp off them, subnormals, the clamp at 448) and on random K/V."""
    heads, d, tokens = 2, 32, 40
    k, v = (t.to(DEVICE) for t in kv_with_edges(tokens, heads, d, k_scale, v_scale, dtype))
    g = torch.Generator().manual_seed(3)
    kc = torch.zeros(8, BS, heads, d, dtype=torch.uint8).view(FP8).to(DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(8 * BS, generator=g)[:tokens].to(DEVICE)
    slots[EDGE_FREE_TOKEN] = -1  # padding: left as it was
    kc_ref, vc_ref = kc.clone().cpu(), vc.clone().cpu()
    kv_store(k, v, kc, vc, slots, k_scale, v_scale)
    reference_kv_store(k.cpu(), v.cpu(), kc_ref, vc_ref, slots.cpu(), k_scale, v_scale)
    assert torch.equal(kc.cpu().view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), vc_ref.view(torch.uint8))
    assert kc.view(torch.uint8).count_nonzero() > 0.9 * (tokens - 1) * heads * d


def test_kv_store_refuses_an_fp8_source_mixed_caches_or_mixed_sources():
    k = torch.randn(2, 1, 16, device=DEVICE)
    kc = torch.zeros(2, BS, 1, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        kv_store(k.to(FP8), k.to(FP8), kc.to(FP8), kc.to(FP8), slots)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kv_store(k, k, kc.to(FP8), kc, slots)
    with pytest.raises(ValueError, match="share a dtype"):
        kv_store(k.to(torch.bfloat16), k, kc, kc, slots)


def test_fp8_widening_is_exact_for_every_code():
    """Each finite e4m3 code (subnormals, ±448) as the only V of a one-token row comes back as its value."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    vc = torch.zeros(len(codes), BS, 1, 16, dtype=torch.uint8)
    vc[:, 0, 0, 0] = codes
    vc8 = vc.view(FP8).to(DEVICE)
    n = len(codes)
    got = paged_attention(torch.zeros(n, 1, 16, device=DEVICE), torch.zeros_like(vc8), vc8,
                          torch.arange(n, dtype=torch.int32, device=DEVICE)[:, None],
                          torch.ones(n, dtype=torch.int32, device=DEVICE),
                          torch.arange(n + 1, dtype=torch.int32, device=DEVICE), 1, 1.0)
    assert torch.equal(got[:, 0, 0].cpu(), codes.view(FP8).float())
