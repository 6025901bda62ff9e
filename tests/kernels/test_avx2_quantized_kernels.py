"""The AVX2 quantized-weight kernels (pagedllm_kernels/cpu/avx2/int4_linear.cpp, fp8_linear.cpp) against the
torch references on the dequantized weight, on the layouts every CPU kernel reads: rows on and around their row
blocks (4 for int4, 3 for fp8), one and several column tiles, int4 group sizes 32/64/128 over several groups,
every finite e4m3 value, with and without bias. They run on any CPU with AVX2, FMA and F16C, AVX-512 ones too."""

import pytest
import torch
from pagedllm_kernels import fp8_layout, int4_layout
from pagedllm_kernels.cpu import avx2_linear
from pagedllm_kernels.cpu import avx2_quantized as avx2
from quant_weights import FP8, fp8_weight, int4_weight

pytestmark = pytest.mark.skipif(not avx2.avx2_supported()[0], reason=avx2.avx2_supported()[1])


def _int4(n, k, group, seed):
    codes, scales, zeros = int4_weight(n, k, group, seed)
    return int4_layout.pack(codes, scales, zeros, group)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 17])
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 256, 64), (80, 384, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_matches_the_reference(rows, n, k, group, with_bias):
    packed, s, m = _int4(n, k, group, seed=rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = torch.randn(n) if with_bias else None
    got = avx2.int4_linear(x, packed, s, m, group, bias)
    want = x.float() @ int4_layout.dequantize(packed, s, m, group).t() + (0 if bias is None else bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # bf16 output: one unit in the last place is 0.4% of the value; fp32 sums in another order
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=1e-2)


def test_int4_dequantize_tiles_gives_the_bf16_kernels_weight():
    packed, s, m = _int4(48, 256, 64, seed=3)
    tiles = avx2.int4_dequantize_tiles(packed, s, m, 64, torch.empty(6, 256, 8, dtype=torch.bfloat16))
    dense = int4_layout.dequantize(packed, s, m, 64)
    # one fused multiply-subtract against the reference's two roundings: at most a bf16 unit apart
    torch.testing.assert_close(avx2_linear.unpack(tiles).float(), dense, atol=1e-6, rtol=8e-3)
    x = torch.randn(70, 256).to(torch.bfloat16)  # a prefill-sized batch through the bf16 kernel
    want = x.float() @ dense.to(torch.bfloat16).float().t()  # on the weight as the tiles round it
    torch.testing.assert_close(avx2_linear.linear(x, tiles).float(), want, atol=2e-3, rtol=1e-2)
    with pytest.raises(RuntimeError, match="N/8, K, 8"):
        avx2.int4_dequantize_tiles(packed, s, m, 64, torch.empty(48, 256, dtype=torch.bfloat16))


def test_int4_linear_refuses_what_it_cannot_read():
    packed, s, m = _int4(16, 64, 32, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        avx2.int4_linear(torch.randn(2, 32).to(torch.bfloat16), packed, s, m, 32)
    with pytest.raises(RuntimeError, match="bf16"):
        avx2.int4_linear(torch.randn(2, 64), packed, s, m, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        avx2.int4_linear(torch.randn(2, 64).to(torch.bfloat16), packed, s, m, 48)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 64])
@pytest.mark.parametrize("n,k", [(16, 64), (48, 96), (80, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_matches_the_reference(rows, n, k, with_bias):
    w, scales = fp8_weight(n, k, seed=rows)
    packed, col_scales = fp8_layout.pack(w, scales)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = torch.randn(n) if with_bias else None
    got = avx2.fp8_linear(x, packed, col_scales, bias)
    want = x.float() @ fp8_layout.dequantize(packed, col_scales).t() + (0 if bias is None else bias)
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=1e-2)  # values up to ~400: bf16 ulps


def test_fp8_linear_reads_every_value_exactly():
    """A one-hot x picks one input: the output is that input's elements times their scales, exactly."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 finite values
    for hot in (0, 1):  # both lanes of an input pair
        w = torch.zeros(256, 2, dtype=torch.uint8)
        w[:len(codes), hot] = codes
        packed, scales = fp8_layout.pack(w.view(FP8), torch.ones(256))
        x = torch.zeros(1, 2).to(torch.bfloat16)
        x[0, hot] = 1
        got = avx2.fp8_linear(x, packed, scales)[0, :len(codes)]
        assert torch.equal(got.float(), codes.view(FP8).float().to(torch.bfloat16).float())


def test_fp8_dequantize_tiles_gives_the_bf16_kernels_weight():
    w, scales = fp8_weight(48, 96, seed=5)
    packed, col_scales = fp8_layout.pack(w, scales)
    tiles = avx2.fp8_dequantize_tiles(packed, col_scales, torch.empty(6, 96, 8, dtype=torch.bfloat16))
    dense = fp8_layout.dequantize(packed, col_scales)
    assert torch.equal(avx2_linear.unpack(tiles), dense.to(torch.bfloat16))  # one rounding of an exact product
    with pytest.raises(RuntimeError, match="N/8, K, 8"):
        avx2.fp8_dequantize_tiles(packed, col_scales, torch.empty(6, 95, 8, dtype=torch.bfloat16))
