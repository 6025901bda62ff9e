// The Python module of the AVX2 kernels (one extension, built from every .cpp in this directory).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", &avx2_bf16_linear, "bf16 x @ W^T + b, W in avx2_linear.py's tiles, fp32 FMAs (AVX2)");
  m.def("int4_linear", &avx2_int4_linear, "bf16 x @ W^T + b, W int4 in int4_layout.py's packing (AVX2)");
  m.def("int4_dequantize_tiles", &avx2_int4_dequantize_tiles,
        "an int4 weight written as bf16_linear's bf16 tiles [N/8, K, 8] (AVX2)");
  m.def("fp8_linear", &avx2_fp8_linear, "bf16 x @ W^T + b, W e4m3 in fp8_layout.py's arrangement (AVX2, F16C)");
  m.def("fp8_dequantize_tiles", &avx2_fp8_dequantize_tiles,
        "an fp8 weight written as bf16_linear's bf16 tiles [N/8, K, 8] (AVX2, F16C)");
  m.def("fp8_round_input", &avx2_fp8_round_input,
        "x rounded to e4m3 at a static, per-row or per-tensor scale, and back (AVX2)");
  m.def("store_kv_fp8", &avx2_store_kv_fp8,
        "k / k_scale and v / v_scale as e4m3 codes into their slots of an fp8 cache, slot -1 skipped (AVX2)");
  m.def("decode_attention", &avx2_decode_attention,
        "each row's one query token over its paged context (torch backend's cache layout, q's dtype or e4m3), "
        "fp32 math (AVX2)");
}
