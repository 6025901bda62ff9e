// AVX2 helpers shared by the kernels of this directory.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

namespace pagedllm_avx2 {

// 8 values as fp32: fp32 loaded as they are, bf16 widened exactly (its bits are fp32's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

}  // namespace pagedllm_avx2
