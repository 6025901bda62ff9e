// The Python module of the AVX2 kernels (one extension, built from every .cpp in this directory).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", &avx2_bf16_linear, "bf16 x @ W^T + b, W in avx2_linear.py's tiles, fp32 FMAs (AVX2)");
  m.def("decode_attention", &avx2_decode_attention,
        "each row's one query token over its paged context (torch backend's cache layout), fp32 math (AVX2)");
}
