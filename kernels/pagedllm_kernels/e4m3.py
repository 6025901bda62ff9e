"""e4m3 (float8_e4m3fn) bytes widened inside Triton kernels by bit moves, so that an fp8 cache or weight needs
no fp8 hardware and runs under the interpreter too."""

import triton
import triton.language as tl


@triton.jit
def e4m3_to_f32(bits):
    """uint8 e4m3 codes -> their values: sign, exponent and mantissa moved into an fp16 (bias 15, not 7: the
    fp16 is the value / 256; e4m3 subnormals land on fp16 subnormals), then widened exactly."""
    b = bits.to(tl.int16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
