"""The CPU kernels on an fp8 (e4m3) KV cache against torch references: the store's rounding (torch's own
float8 conversion is the oracle, bit for bit, subnormals and clamping included), and attention over the
dequantized cache at block-boundary lengths, GQA ratios, head dims, windows and per-tensor scales."""

import pytest
import torch
from pagedllm_kernels.cpu import kv_layout
from pagedllm_kernels.cpu import paged_attention as kernel

supported, why = kernel.cpu_supported()
pytestmark = pytest.mark.skipif(not supported, reason=why)

FP8 = torch.float8_e4m3fn
LENS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 161]
# The kernel and the reference read the same fp8 values; they differ by the bf16 rounding of the query and of
# the attention weights (as in the bf16 cache's tolerance) only.
TOLERANCE = dict(atol=1e-2, rtol=8e-3)


def fp8_cache(num_blocks, block_size, kv_heads, head_dim, scale, g):
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 2
    return (values / scale).clamp(-448, 448).to(FP8)


def make(heads, kv_heads, head_dim, block_size, lens=LENS, seed=0, k_scale=1.0, v_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 3
    kc = fp8_cache(num_blocks, block_size, kv_heads, head_dim, k_scale, g)
    vc = fp8_cache(num_blocks, block_size, kv_heads, head_dim, v_scale, g)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(lens), max(per_row) + 2, dtype=torch.int64)
    used = 0
    for i, n in enumerate(per_row):
        tables[i, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(torch.bfloat16)
    return q, kc, vc, tables, torch.tensor(lens)


def attend(q, kc, vc, tables, lens, scale, window=None, k_scale=1.0, v_scale=1.0):
    return kernel.paged_attention(q, *kv_layout.to_kernel_layout(kc, vc), tables, lens, scale, window,
                                  k_scale, v_scale)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (12, 4, 64), (8, 1, 128), (6, 2, 96), (16, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_over_an_fp8_cache_matches_the_reference(heads, kv_heads, head_dim, block_size):
    q, kc, vc, tables, lens = make(heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    got = attend(q, kc, vc, tables, lens, scale)
    ref = kernel.reference(q, kc, vc, tables, lens, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE)


@pytest.mark.parametrize("window", [None, 7, 40])
def test_per_tensor_scales_and_windows(window):
    q, kc, vc, tables, lens = make(8, 2, 64, 16, k_scale=0.05, v_scale=3.0)
    got = attend(q, kc, vc, tables, lens, 0.125, window, 0.05, 3.0)
    ref = kernel.reference(q, kc, vc, tables, lens, 0.125, window, 0.05, 3.0)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=8e-3)  # values up to ~6: bf16 ulps


def test_few_rows_split_over_kv_heads():
    q, kc, vc, tables, lens = make(12, 4, 64, 16, lens=[161, 33])
    torch.testing.assert_close(attend(q, kc, vc, tables, lens, 0.125).float(),
                               kernel.reference(q, kc, vc, tables, lens, 0.125).float(), **TOLERANCE)


@pytest.mark.parametrize("heads", [1, 16], ids=["widened_in_place", "widened_into_scratch"])
def test_every_e4m3_value_reads_back_exactly(heads):
    """All 254 finite e4m3 values (subnormals and ±448 included) as V, one per token: a one-hot query over a
    softmax of equal scores makes each output the mean of V's values, computed from exactly what was read.
    16 query heads on the one KV head take more than one pass over each run: it is widened once into scratch."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # not the NaNs
    values = codes.view(FP8).float()
    block_size, n = 16, 256
    vc = torch.zeros(n // block_size, block_size, 1, 32, dtype=FP8)
    flat = vc.view(-1, 32)
    flat[:len(codes), 0] = codes.view(FP8)
    kc = torch.zeros_like(vc)  # all scores 0: uniform weights over the row's tokens
    tables = torch.arange(n // block_size)[None]
    for length in (1, 17, len(codes)):
        out = attend(torch.zeros(1, heads, 32, dtype=torch.bfloat16), kc, vc, tables, torch.tensor([length]), 1.0)
        expected = values[:length].mean()
        assert (out[0, :, 0].float() - expected).abs().max().item() <= 4e-3 * max(1.0, abs(expected.item()))
    # each value alone: the output is the value itself (rounded to bf16 once)
    for c, value in zip(codes.tolist(), values.tolist()):
        one = torch.zeros(1, block_size, 1, 32, dtype=FP8)
        one.view(-1, 32)[0, 0] = torch.tensor([c], dtype=torch.uint8).view(FP8)
        out = attend(torch.zeros(1, heads, 32, dtype=torch.bfloat16), torch.zeros_like(one), one, tables[:, :1],
                     torch.tensor([1]), 1.0)
        assert (out[0, :, 0] == torch.tensor(value).to(torch.bfloat16)).all().item(), hex(c)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_rounds_like_torch_and_clamps(source, block_size):
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(6, block_size, 2, 64, generator=g).to(FP8)
    vc = torch.randn(6, block_size, 2, 64, generator=g).to(FP8)
    kc, vc = kv_layout.to_kernel_layout(kc, vc)
    qkv = torch.randn(9, 3 * 2 * 64, generator=g) * torch.logspace(-4, 3, 3 * 2 * 64)  # subnormals to beyond 448
    qkv = qkv.to(source)
    k, v = qkv[:, 128:256].view(9, 2, 64), qkv[:, 256:].view(9, 2, 64)
    slots = torch.tensor([0, 5, -1, block_size, 2 * block_size + 3, 95, -1, 4 * block_size - 1, 1])
    got_k, got_v = kc.clone(), vc.clone()
    kv_layout.store_kv(k, v, got_k, got_v, slots, 0.5, 2.0)
    kv_layout.reference_store_kv(k, v, kc, vc, slots, 0.5, 2.0)
    assert torch.equal(got_k.view(torch.uint8), kc.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), vc.view(torch.uint8))
    plain_v = kv_layout.from_kernel_layout(got_k, got_v)[1].view(-1, 2, 64)
    assert plain_v.float().abs().max() == 448  # clamped, never NaN
    assert not plain_v.float().isnan().any()


def test_fp8_needs_a_bf16_query():
    q, kc, vc, tables, lens = make(4, 2, 64, 16)
    with pytest.raises(RuntimeError, match="float8_e4m3fn with a bfloat16 q"):
        attend(q.float(), kc, vc, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="scales must be positive"):
        attend(q, kc, vc, tables, lens, 0.125, None, 0.0, 1.0)
