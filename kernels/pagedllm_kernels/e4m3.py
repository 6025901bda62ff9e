"""e4m3 (float8_e4m3fn) bytes widened and written inside Triton kernels by bit moves, so that an fp8 cache or
weight needs no fp8 hardware and runs under the interpreter too."""

import triton
import triton.language as tl


@triton.jit
def e4m3_to_f32(bits):
    """uint8 e4m3 codes -> their values: sign, exponent and mantissa moved into an fp16 (bias 15, not 7: the
    fp16 is the value / 256; e4m3 subnormals land on fp16 subnormals), then widened exactly."""
    b = bits.to(tl.int16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def f32_to_e4m3(x):
    """fp32 values (already divided by the scale) -> uint8 e4m3 codes, round to nearest even, clamped to +-448:
    torch's .to(float8_e4m3fn) of the clamped values, bit for bit (finite values; NaN is clamped to a bound,
    as by the C++ stores, where torch keeps e4m3's NaN). Normal range: the fp32 rounded at mantissa
    bit 20 and its exponent rebiased (127 -> 7). Below 2^-6 the code is round(|x| * 2^9): adding 2^14 leaves
    exactly that many units of 2^-9 in the fp32's mantissa, rounded to nearest even by the add itself."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000  # the fp32 bits of 2^14
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.uint8)
