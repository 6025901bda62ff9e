"""The W8A8 int8 kernel (AVX512-VNNI) against its torch reference (the same quantization, integer sums in
int64): rows around its row blocks of 8, column tiles, bf16 and fp32 inputs, bias, zero rows; and the weight
quantization's error bound."""

import pytest
import torch
from pagedllm_kernels.cpu import int8_linear as kernel

ok, why = kernel.vnni_supported()
pytestmark = pytest.mark.skipif(not ok, reason=why)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
@pytest.mark.parametrize("n,k", [(16, 64), (48, 96), (80, 768)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_linear_matches_the_reference(rows, n, k, dtype):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=g) * 0.05
    packed, scales, wsum = kernel.quantize_weight(w)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    x[0, :] = 0 if rows > 2 else x[0, :]  # an all-zero row: scale 1, output = bias
    bias = torch.randn(n, generator=g)
    got = kernel.linear(x, packed, scales, wsum, bias)
    want = kernel.reference(x, packed, scales, wsum, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    # identical integer sums; the fp32 rescale may round differently, then bf16 rounding
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_weight_quantization_is_within_half_a_step():
    w = torch.randn(32, 128)
    packed, scales, wsum = kernel.quantize_weight(w)
    q = packed.permute(0, 2, 1, 3).reshape(32, 128).float()
    assert ((q * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()
    assert torch.equal(wsum, q.sum(1).int())
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.quantize_weight(torch.randn(24, 128))
