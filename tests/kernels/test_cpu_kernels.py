"""The AVX-512 paged decode attention kernel and its KV store against their torch references: decode rows
over shuffled block tables, lengths on and around block boundaries, GQA ratios, head dims, fp32 and bf16,
sliding windows; the fused ops."""

import pytest
import torch
from cpu_caches import poison_outside_rows
from pagedllm_kernels.cpu import amx_linear, kv_layout
from pagedllm_kernels.cpu import paged_attention as kernel

supported, why = kernel.cpu_supported()
pytestmark = pytest.mark.skipif(not supported, reason=why)

LENS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 161]
# bf16: the outputs are rounded to bf16 (one unit in the last place is 0.4% of the value) and the attention
# weights are rounded to bf16 before they multiply V, as flash attention does.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=0), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def attend(q, kc, vc, tables, lens, scale, window=None):
    """The kernel on caches given in the plain layout (the references read that one)."""
    return kernel.paged_attention(q, *kv_layout.to_kernel_layout(kc, vc), tables, lens, scale, window)


def make(num_heads, num_kv_heads, head_dim, block_size, dtype, lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # shuffled, never the null block 0
    tables = torch.zeros(len(lens), max(per_row) + 2, dtype=torch.int64)  # padded with block 0
    used = 0
    for i, n in enumerate(per_row):
        tables[i, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (4, 2, 64), (12, 4, 64), (8, 1, 128), (6, 2, 96),
                                                     (16, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_the_reference(dtype, heads, kv_heads, head_dim, block_size):
    q, kc, vc, tables, lens = make(heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    got = attend(q, kc, vc, tables, lens, scale)
    ref = kernel.reference(q, kc, vc, tables, lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_few_rows_are_split_over_kv_heads(dtype):
    """Under 4 rows per thread the kernel hands out (row, KV head) items instead of whole rows."""
    q, kc, vc, tables, lens = make(12, 4, 64, 16, dtype, lens=[161, 33])
    got = attend(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), kernel.reference(q, kc, vc, tables, lens, 0.125).float(),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_sliding_window(window, dtype):
    q, kc, vc, tables, lens = make(8, 2, 64, 16, dtype)  # odd windows start mid token-pair in bf16
    got = attend(q, kc, vc, tables, lens, 0.125, window)
    ref = kernel.reference(q, kc, vc, tables, lens, 0.125, window)
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("window", [None, 20])
def test_many_decodes_over_tables_as_wide_as_their_contexts(window):
    """Decode rows enough for whole-row items, several per thread, each claimed while the thread requests the
    next one's first blocks: every row is attended once, with tables exactly as wide as the longest context."""
    lens = [1 + (37 * i) % 300 for i in range(48)]
    q, kc, vc, tables, lens_t = make(12, 4, 64, 16, torch.bfloat16, lens=lens, seed=3)
    tables = tables[:, :max(-(-n // 16) for n in lens)].contiguous()  # no padding columns
    got = attend(q, kc, vc, tables, lens_t, 0.125, window)
    ref = kernel.reference(q, kc, vc, tables, lens_t, 0.125, window)
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE[torch.bfloat16])


def test_strided_queries_are_read_in_place():
    q, kc, vc, tables, lens = make(12, 4, 64, 16, torch.bfloat16)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 4 * 64).to(q.dtype)], dim=1)
    strided = qkv[:, :12 * 64].view(-1, 12, 64)  # the model's q: a view into the qkv projection
    assert not strided.is_contiguous()
    torch.testing.assert_close(attend(strided, kc, vc, tables, lens, 0.125), attend(q, kc, vc, tables, lens, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_only_the_rows_blocks_are_read(dtype):
    """Poisoning every block no row owns (and the padding block 0), and each row's last block past its length,
    must not change any output."""
    q, kc, vc, tables, lens = make(4, 2, 64, 16, dtype)
    before = attend(q, kc, vc, tables, lens, 0.125)
    poison_outside_rows(kc, vc, tables, lens, 16)
    torch.testing.assert_close(attend(q, kc, vc, tables, lens, 0.125), before)


def test_the_launcher_checks_its_inputs():
    q, kc, vc, tables, lens = make(4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="do not group"):
        kernel.paged_attention(q[:, :3], kc, vc, tables, lens, 0.125)
    with pytest.raises(ValueError, match="one block table row"):
        kernel.paged_attention(q, kc, vc, tables[:2], lens, 0.125)
    with pytest.raises(ValueError, match="shapes"):
        kernel.paged_attention(q, kc, vc[..., :32], tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.paged_attention(q, kc.to(torch.bfloat16), vc.to(torch.bfloat16), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="block_size"):
        kernel.paged_attention(q, kc[:, :8], vc[:, :8], tables, lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_writes_the_kernel_layout(dtype, block_size):
    g = torch.Generator().manual_seed(3)
    kc, vc = (torch.randn(6, block_size, 2, 64, generator=g).to(dtype) for _ in range(2))
    kc, vc = kv_layout.to_kernel_layout(kc, vc)
    qkv = torch.randn(9, 3 * 2 * 64, generator=g).to(dtype)  # k and v as strided views, as in the model
    k, v = qkv[:, 128:256].view(9, 2, 64), qkv[:, 256:].view(9, 2, 64)
    slots = torch.tensor([0, 5, -1, block_size, 2 * block_size + 3, 95, -1, 4 * block_size - 1, 1])
    got_k, got_v = kc.clone(), vc.clone()
    kv_layout.store_kv(k, v, got_k, got_v, slots)
    kv_layout.reference_store_kv(k, v, kc, vc, slots)
    assert torch.equal(got_k, kc) and torch.equal(got_v, vc)
    plain_k, _ = kv_layout.from_kernel_layout(got_k, got_v)
    assert torch.equal(plain_k.view(-1, 2, 64)[slots[1]], k[1])  # the layouts round-trip


def test_store_kv_checks_its_inputs():
    kc = vc = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="slots"):
        kv_layout.store_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="shapes"):
        kv_layout.store_kv(torch.zeros(2, 2, 32), torch.zeros(2, 2, 32), kc, vc, torch.tensor([0, 1]))


def _bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _ulps_apart(a, b):
    """Distance in bf16 units in the last place, elementwise (both bf16)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rms_norm(dtype):
    from pagedllm_kernels.cpu import fused_ops

    x, w = _bf16(37, 200, scale=3.0).to(dtype), _bf16(200, seed=1).to(dtype)  # 200: a 16-wide tail of 8
    got, ref = fused_ops.rms_norm(x, w, 1e-6), fused_ops.reference_rms_norm(x, w, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        assert _ulps_apart(got, ref).max() <= 1 and (got == ref).float().mean() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_add_rms_norm_updates_both_in_place(dtype):
    from pagedllm_kernels.cpu import fused_ops

    x, res = _bf16(37, 200, scale=3.0).to(dtype), _bf16(37, 200, seed=2, scale=3.0).to(dtype)
    w = _bf16(200, seed=1).to(dtype)
    ref_out, ref_sum = fused_ops.reference_add_rms_norm(x, res, w, 1e-6)
    x_ptr, res_ptr = x.data_ptr(), res.data_ptr()
    got_out, got_sum = fused_ops.add_rms_norm_(x, res, w, 1e-6)
    assert got_out.data_ptr() == x_ptr and got_sum.data_ptr() == res_ptr
    assert torch.equal(got_sum, ref_sum)  # the sum is rounded once, as the torch add rounds it
    if dtype == torch.float32:
        torch.testing.assert_close(got_out, ref_out, atol=1e-5, rtol=1e-5)
    else:
        assert _ulps_apart(got_out, ref_out).max() <= 1 and (got_out == ref_out).float().mean() > 0.98


def test_a_model_off_the_cpu_neither_builds_nor_loads_the_cpu_kernels(monkeypatch):
    from pagedllm.models.layers import fused
    from pagedllm_kernels.cpu import build

    def no_build():
        raise AssertionError("built for a GPU model")
    monkeypatch.setattr(build, "extension", no_build)
    assert [load("cuda:0") for load in (fused.load_fused_ops, fused.load_token_mask, fused.load_lora_kernel)] == [
        None, None, None]


def test_rms_norm_module_with_a_residual_matches_the_torch_path():
    """The decoder's norm(x, residual): fused in place for bf16 once use_fused_ops hands it the ops, the torch
    add + norm otherwise."""
    from pagedllm.models.layers.fused import load_fused_ops, use_fused_ops
    from pagedllm.models.layers.norm import RMSNorm

    norm = RMSNorm(200, 1e-6).to(torch.bfloat16)
    norm.weight.data = _bf16(200, seed=1)
    x, res = _bf16(5, 200, scale=3.0), _bf16(5, 200, seed=2, scale=3.0)
    torch_out, torch_sum = norm(x.clone(), res.clone())  # built without fused ops: the torch path
    assert use_fused_ops(norm, load_fused_ops()) == 1
    fused_out, fused_sum = norm(x.clone(), res.clone())
    assert torch.equal(fused_sum, torch_sum) and torch.equal(torch_sum, x + res)
    assert _ulps_apart(fused_out, torch_out).max() <= 1


def test_fused_silu_and_mul():
    from pagedllm_kernels.cpu import fused_ops

    x = _bf16(9, 2 * 344, scale=4.0)  # 344 = 21 x 16 + 8
    got, ref = fused_ops.silu_and_mul(x), fused_ops.reference_silu_and_mul(x)
    assert got.shape == (9, 344)
    assert _ulps_apart(got, ref).max() <= 1 and (got == ref).float().mean() > 0.98


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_fused_rotary_in_place_on_a_strided_view(head_dim):
    from pagedllm_kernels.cpu import fused_ops

    t, heads = 11, 3
    qkv = _bf16(t, heads * head_dim + 40, scale=2.0)
    q = qkv[:, :heads * head_dim].reshape(t, heads, head_dim)  # rows strided, as the model's q is
    angles = torch.rand(t, 1, head_dim // 2, generator=torch.Generator().manual_seed(2)) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    ref = fused_ops.reference_rotary(q.clone(), cos, sin)
    tail = qkv[:, heads * head_dim:].clone()
    got = fused_ops.rotary_(q, cos, sin)
    assert got.data_ptr() == q.data_ptr() and torch.equal(qkv[:, heads * head_dim:], tail)
    assert _ulps_apart(got, ref).max() <= 1 and (got == ref).float().mean() > 0.98


def test_fused_launchers_check_their_inputs():
    from pagedllm_kernels.cpu import fused_ops

    with pytest.raises(ValueError, match="disagree"):
        fused_ops.rms_norm(_bf16(2, 64), _bf16(32), 1e-6)
    with pytest.raises(ValueError, match="disagree"):
        fused_ops.add_rms_norm_(_bf16(2, 64), _bf16(3, 64), _bf16(64), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        fused_ops.add_rms_norm_(_bf16(64, 2).t(), _bf16(2, 64), _bf16(64), 1e-6)
    with pytest.raises(ValueError, match="gate and up"):
        fused_ops.silu_and_mul(_bf16(2, 63))
    with pytest.raises(ValueError, match="multiple of 32"):
        fused_ops.rotary_(_bf16(2, 1, 48), _bf16(2, 1, 24), _bf16(2, 1, 24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_argmax_takes_the_first_of_ties(dtype):
    from pagedllm_kernels.cpu import fused_ops

    x = _bf16(33, 1000 + 7, scale=5.0).to(dtype)  # 1007: a tail past the 16-wide part
    x[3, 100] = x[3, 900] = 50.0  # a tie: the first wins
    x[4, 1005] = 60.0  # the maximum in the tail
    x[5, :] = 1.0  # all equal: index 0
    got = fused_ops.argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, fused_ops.reference_argmax(x))
    assert got[3] == 100 and got[4] == 1005 and got[5] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab,words", [(1, 1), (31, 1), (32, 1), (33, 2), (1000, 32), (32000, 1000),
                                         (100, 2), (65, 3)])  # (100, 2) and (65, 3): a mask narrower / wider
def test_token_mask_kernel_matches_the_reference(dtype, vocab, words):
    from pagedllm_kernels.cpu import token_mask

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen).to(dtype)
    rows = [7, 0, 3, 8]
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (len(rows), words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0  # none
    got, want = logits.clone(), logits.clone()
    token_mask.mask_logits_(got, rows, bitmask)
    token_mask.reference_mask_logits_(want, rows, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 2, 4, 5, 6]], logits[[1, 2, 4, 5, 6]])  # rows without a mask are untouched
    assert torch.equal(got[0], logits[0]) == (words * 32 >= vocab) and torch.isinf(got[3]).all()
    with pytest.raises(RuntimeError, match="outside"):
        token_mask.mask_logits_(got, [9], bitmask[:1])


amx_ok, amx_why = amx_linear.amx_supported()


@pytest.mark.skipif(not amx_ok, reason=amx_why)
@pytest.mark.parametrize("rows,in_features,out_features", [
    (1, 64, 32), (5, 96, 64), (33, 768, 768), (64, 256, 1280),
    (700, 2048, 64),  # three passes over the weight: 8, 8 and 6 row blocks, each in chunks of K
    (300, 800, 96),  # 8 row blocks in chunks (25 K steps: the last chunk partial), then 2 taking panels whole
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_matches_f_linear(rows, in_features, out_features, with_bias):
    x, w = _bf16(rows, in_features, seed=1), _bf16(out_features, in_features, seed=2)
    b = _bf16(out_features, seed=3) if with_bias else None
    got = amx_linear.linear(x, amx_linear.pack(w), None if b is None else b.float())
    ref = amx_linear.reference(x, w, b)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    # fp32 sums of exact bf16 products, rounded once: as oneDNN's, up to the order of the sums (which moves
    # an output by a unit in the last place now and then, two where a sum nearly cancels).
    assert (got == ref).float().mean() > 0.99
    exact = x.float() @ w.float().T + (0 if b is None else b.float())
    torch.testing.assert_close(got.float(), exact, atol=0.05, rtol=1e-2)


@pytest.mark.skipif(not amx_ok, reason=amx_why)
def test_amx_linear_reads_strided_rows_and_checks_its_inputs():
    wide, w = _bf16(7, 128, seed=4), _bf16(64, 64, seed=5)
    x = wide[:, ::2]  # columns strided
    assert (amx_linear.linear(x, amx_linear.pack(w)) == amx_linear.reference(x, w)).float().mean() > 0.99
    with pytest.raises(ValueError, match="multiples of 32"):
        amx_linear.pack(_bf16(48, 64))
    with pytest.raises(ValueError, match="does not fit"):
        amx_linear.linear(_bf16(3, 32), amx_linear.pack(w))
    with pytest.raises(RuntimeError, match="bias"):
        amx_linear.linear(_bf16(3, 64), amx_linear.pack(w), torch.zeros(32))
