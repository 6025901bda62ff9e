"""The fp8-weight kernels (C++ on AVX512-BF16 CPUs and on AVX2 ones, Triton under the interpreter or on a GPU)
against the torch reference: rows around the C++ kernels' row blocks, one and several column tiles, every e4m3
value (subnormals and ±448) in either input of a pair, per-column scales, with and without bias; the layout's
round trip."""

import pytest
import torch
from pagedllm_kernels import fp8_layout
from pagedllm_kernels.cpu import avx2_quantized as avx2
from pagedllm_kernels.cpu import fp8_linear as cpu
from pagedllm_kernels.fp8_matmul import fp8_matmul, reference_fp8_matmul
from quant_weights import FP8
from quant_weights import fp8_weight as weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_layout_round_trip():
    w, s = weight(48, 64)
    packed, scales = fp8_layout.pack(w, s)
    torch.testing.assert_close(fp8_layout.dequantize(packed, scales), w.float() * s[:, None])
    assert packed[2, 5, 3, 1].view(torch.uint8) == w[32 + 3, 11].view(torch.uint8)  # tile 2, pair 5, lane 3
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_layout.pack(w[:40], s[:40])


cpu_ok, cpu_why = cpu.cpu_supported()
avx2_ok, avx2_why = avx2.avx2_supported()
# Both CPU kernels read this layout: the AVX512-BF16 one, and the AVX2 one for CPUs without AVX-512.
CPU_KERNELS = [pytest.param(cpu.linear, marks=pytest.mark.skipif(not cpu_ok, reason=cpu_why), id="avx512"),
               pytest.param(avx2.fp8_linear, marks=pytest.mark.skipif(not avx2_ok, reason=avx2_why), id="avx2")]


@pytest.mark.parametrize("linear", CPU_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64])  # around both kernels' row blocks (8; 3)
@pytest.mark.parametrize("n,k", [(16, 64), (48, 96), (80, 256), (16, 34), (208, 70)])  # pairs past the chains
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_fp8_linear_matches_the_reference(linear, rows, n, k, with_bias):
    w, s = weight(n, k, seed=rows)
    packed, scales = fp8_layout.pack(w, s)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = torch.randn(n) if with_bias else None
    got = linear(x, packed, scales, bias)
    want = cpu.reference(x, packed, scales, bias)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=1e-2)  # values up to ~400: bf16 ulps


@pytest.mark.parametrize("linear", CPU_KERNELS)
@pytest.mark.parametrize("hot", [0, 1])  # either input of a pair
def test_cpu_fp8_reads_every_value_exactly(linear, hot):
    """A one-hot x picks one input row: the output is that row's elements times their scales, exactly."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 finite values
    w = torch.zeros(256, 2, dtype=torch.uint8)
    w[:len(codes), hot] = codes
    packed, scales = fp8_layout.pack(w.view(FP8), torch.ones(256))
    x = torch.zeros(1, 2).to(torch.bfloat16)
    x[0, hot] = 1
    got = linear(x, packed, scales)[0, :len(codes)]
    assert torch.equal(got.float(), codes.view(FP8).float().to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 16, 64), (9, 80, 96), (33, 64, 256)])
def test_triton_fp8_matmul_matches_the_reference(dtype, rows, n, k):
    w, s = weight(n, k, seed=rows)
    packed, scales = (t.to(DEVICE) for t in fp8_layout.pack(w, s))
    x = torch.randn(rows, k).to(dtype).to(DEVICE)
    bias = torch.randn(n, device=DEVICE)
    got = fp8_matmul(x, packed, scales, bias)
    want = reference_fp8_matmul(x, packed, scales, bias)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol * 10, rtol=tol)


ROUNDERS = [pytest.param(cpu.round_input, marks=pytest.mark.skipif(not cpu_ok, reason=cpu_why), id="avx512"),
            pytest.param(avx2.fp8_round_input, marks=pytest.mark.skipif(not avx2_ok, reason=avx2_why), id="avx2")]


@pytest.mark.parametrize("round_input", ROUNDERS)
@pytest.mark.parametrize("mode", ["static", "dynamic", "dynamic_token"])
def test_cpu_fp8_input_rounding_matches_torch(round_input, mode):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 96, generator=g) * torch.logspace(-3, 1, 96)).to(torch.bfloat16)
    x[3] = 0  # an all-zero row
    static = 0.01 if mode == "static" else None  # clamps the largest values at 4.48
    got = round_input(x, static, mode == "dynamic_token")
    want = cpu.reference_round_input(x, static, mode == "dynamic_token")
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3)  # one bf16 rounding of value * scale
    assert not torch.equal(got, x)


@pytest.mark.parametrize("round_input", ROUNDERS)
def test_cpu_fp8_input_rounding_hits_every_value(round_input):
    """At scale 1, every finite e4m3 value, the midpoints between neighbours (ties to even), values just off
    them, and magnitudes past 448 round exactly as torch's cast does."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8).view(FP8).float()
    values = codes.sort().values
    mids = ((values[1:] + values[:-1]) / 2).to(torch.bfloat16)  # exact: e4m3 has 3 mantissa bits, bf16 7
    off = [(mids.view(torch.int16) + d).view(torch.bfloat16) for d in (-1, 1)]  # the bf16 neighbours
    off = [o[o.isfinite()] for o in off]  # 0's neighbour below, bits 0xFFFF, is a NaN
    x = torch.cat([values.to(torch.bfloat16), mids, *off, torch.tensor([500.0, -1e4, 449.0]).to(torch.bfloat16)])
    x = torch.cat([x, x.new_zeros(-x.numel() % 32)]).reshape(1, -1)
    got = round_input(x, 1.0, False)
    want = cpu.reference_round_input(x, 1.0, False)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
