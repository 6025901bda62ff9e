"""What only the AVX2 quantized-weight kernels have (pagedllm_kernels/cpu/avx2/int4_linear.cpp, fp8_linear.cpp):
the writers of a weight as the AVX2 bf16 kernel's tiles, and the refusals. Their linears are tested against
the torch references beside the AVX-512 kernels' (test_int4_kernels.py, test_fp8_weight_kernels.py). They run
on any CPU with AVX2, FMA and F16C, AVX-512 ones too."""

import pytest
import torch
from pagedllm_kernels import fp8_layout, int4_layout
from pagedllm_kernels.cpu import avx2_linear
from pagedllm_kernels.cpu import avx2_quantized as avx2
from quant_weights import fp8_weight, int4_weight

pytestmark = pytest.mark.skipif(not avx2.avx2_supported()[0], reason=avx2.avx2_supported()[1])


def _int4(n, k, group, seed):
    codes, scales, zeros = int4_weight(n, k, group, seed)
    return int4_layout.pack(codes, scales, zeros, group)


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


def test_fp8_dequantize_tiles_gives_the_bf16_kernels_weight():
    w, scales = fp8_weight(48, 96, seed=5)
    packed, col_scales = fp8_layout.pack(w, scales)
    tiles = avx2.fp8_dequantize_tiles(packed, col_scales, torch.empty(6, 96, 8, dtype=torch.bfloat16))
    dense = fp8_layout.dequantize(packed, col_scales)
    assert torch.equal(avx2_linear.unpack(tiles), dense.to(torch.bfloat16))  # one rounding of an exact product
    with pytest.raises(RuntimeError, match="N/8, K, 8"):
        avx2.fp8_dequantize_tiles(packed, col_scales, torch.empty(6, 95, 8, dtype=torch.bfloat16))
