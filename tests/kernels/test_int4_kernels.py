"""The int4 kernels (C++ on AVX512-BF16 CPUs and on AVX2 ones, Triton under the interpreter or on a GPU) against
the torch reference on the dequantized weight: rows on and around the C++ kernels' row blocks (8; 4), one and
several column tiles, group sizes 32/64/128 over several groups, with and without bias; the layout's pack round
trip."""

import pytest
import torch
from pagedllm_kernels import int4_layout
from pagedllm_kernels.cpu import avx2_quantized as avx2
from pagedllm_kernels.cpu import int4_linear as cpu
from pagedllm_kernels.int4_matmul import int4_matmul, reference_int4_matmul
from quant_weights import int4_weight as weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_layout_round_trip():
    codes, scales, zeros = weight(48, 256, 64)
    packed, s, m = int4_layout.pack(codes, scales, zeros, 64)
    dense = int4_layout.dequantize(packed, s, m, 64)
    want = (codes.float() - zeros.float().repeat_interleave(64, 1)) * scales.repeat_interleave(64, 1)
    torch.testing.assert_close(dense, want, atol=1e-6, rtol=1e-6)
    assert packed[1, 3, 5] == codes[16 + 5, 6] | (codes[16 + 5, 7] << 4)  # tile 1, input pair 3, lane 5


@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 256, 64), (80, 384, 128), (32, 128, 128)])
def test_layout_refuses_what_the_kernels_cannot_read(n, k, group):
    int4_layout.check_shapes(n, k, group)
    with pytest.raises(ValueError, match="multiple of 16"):
        int4_layout.check_shapes(n + 8, k, group)
    with pytest.raises(ValueError, match="group size"):
        int4_layout.check_shapes(n, k + 32, 48)


cpu_ok, cpu_why = cpu.cpu_supported()
avx2_ok, avx2_why = avx2.avx2_supported()


# Both CPU kernels read this layout: the AVX512-BF16 one, and the AVX2 one for CPUs without AVX-512.
@pytest.mark.parametrize("linear", [
    pytest.param(cpu.linear, marks=pytest.mark.skipif(not cpu_ok, reason=cpu_why), id="avx512"),
    pytest.param(avx2.int4_linear, marks=pytest.mark.skipif(not avx2_ok, reason=avx2_why), id="avx2")])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17, 64])  # around both kernels' row blocks (8; 4)
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 256, 64), (80, 384, 128), (208, 64, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_int4_linear_matches_the_reference(linear, rows, n, k, group, with_bias):
    codes, scales, zeros = weight(n, k, group, seed=rows)
    packed, s, m = int4_layout.pack(codes, scales, zeros, group)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = torch.randn(n) if with_bias else None
    got = linear(x, packed, s, m, group, bias)
    want = cpu.reference(x, packed, s, m, group, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # bf16 output: one unit in the last place is 0.4% of the value; fp32 sums in another order
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=1e-2)


@pytest.mark.skipif(not cpu_ok, reason=cpu_why)
def test_cpu_int4_linear_reads_strided_rows_and_dequantizes():
    codes, scales, zeros = weight(48, 256, 64)
    packed, s, m = int4_layout.pack(codes, scales, zeros, 64)
    wide = torch.randn(5, 512).to(torch.bfloat16)
    x = wide[:, :256]  # rows with a stride, as a view of a wider activation
    torch.testing.assert_close(cpu.linear(x, packed, s, m, 64), cpu.linear(x.contiguous(), packed, s, m, 64))
    out = torch.empty(48, 256, dtype=torch.bfloat16)
    cpu.dequantize_into(packed, s, m, 64, out)
    # one fused multiply-subtract against the reference's two roundings: at most a bf16 unit apart
    torch.testing.assert_close(out.float(), int4_layout.dequantize(packed, s, m, 64), atol=1e-6, rtol=8e-3)
    with pytest.raises(ValueError, match="does not fit"):
        cpu.linear(torch.randn(2, 128).to(torch.bfloat16), packed, s, m, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.linear(torch.randn(2, 256), packed, s, m, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k,group", [(1, 16, 64, 32), (9, 80, 256, 64), (33, 64, 256, 128)])
def test_triton_int4_matmul_matches_the_reference(dtype, rows, n, k, group):
    codes, scales, zeros = weight(n, k, group, seed=rows)
    packed, s, m = (t.to(DEVICE) for t in int4_layout.pack(codes, scales, zeros, group))
    x = torch.randn(rows, k).to(dtype).to(DEVICE)
    bias = torch.randn(n, device=DEVICE)
    got = int4_matmul(x, packed, s, m, group, bias)
    want = reference_int4_matmul(x, packed, s, m, group, bias)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="group size"):
        int4_matmul(x, packed, s, m, 48)
