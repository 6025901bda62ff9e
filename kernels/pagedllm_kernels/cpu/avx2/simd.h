// AVX2 helpers shared by the kernels of this directory.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <optional>

namespace pagedllm_avx2 {

// 8 values as fp32: fp32 loaded as they are, bf16 widened exactly (its bits are fp32's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 fp32 -> 8 bf16, round to nearest even (as torch's .to(bfloat16)).
inline __m128i to_bf16_8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// e4m3 (float8_e4m3fn) elements as fp32 through F16C, exactly but scaled by 2^-8 (callers fold the 256 into a
// scale they apply anyway). An e4m3 byte s.eeee.mmm shifted left by 7 into a half is s.0eeee.mmm0000000: the
// same digits with half's exponent bias (15) instead of e4m3's (7), subnormals included; e4m3's NaN (never
// stored: values are clamped to +-448) would read as 480.
constexpr float kE4m3Unscale = 256.0f;
inline __m256i e4m3_as_halves16(__m128i bytes) {  // 16 bytes -> 16 halves
  const __m256i wide = _mm256_cvtepi8_epi16(bytes);  // sign-extended: bit 15 is the sign
  return _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
inline __m256 load8_e4m3_div256(const void* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i wide = _mm_cvtepi8_epi16(bytes);
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(static_cast<short>(0xBFFF))));
}

// v rounded to the nearest e4m3 value (ties to even), clamped to +-448, as fp32 (every e4m3 value is one):
// normal magnitudes (>= 2^-6) keep 3 mantissa bits, subnormal ones become multiples of 2^-9.
inline __m256 round_to_e4m3(__m256 v) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign_bit, v), _mm256_set1_ps(448.0f));
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), odd));
  const __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(~0xFFFFF)));
  const __m256 sub = _mm256_mul_ps(
      _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
      _mm256_set1_ps(1.0f / 512.0f));
  const __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
  return _mm256_or_ps(_mm256_blendv_ps(normal, sub, small), _mm256_and_ps(v, sign_bit));
}

// 8 e4m3 values as fp32 (round_to_e4m3's) -> their 8 codes, in the low 8 bytes: each value / 256 is exactly a
// half whose bits are the code's shifted left by 7 (e4m3_as_halves16 in reverse), sign included.
inline __m128i e4m3_codes8(__m256 e4m3_values) {
  const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(e4m3_values, _mm256_set1_ps(1.0f / kE4m3Unscale)),
                                    _MM_FROUND_TO_NEAREST_INT);
  const __m128i codes = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(h, 7), _mm_set1_epi16(0x7F)),
                                     _mm_and_si128(_mm_srli_epi16(h, 8), _mm_set1_epi16(0x80)));
  return _mm_packus_epi16(codes, codes);
}

// The linears' shared input checks: x bf16 [rows, k], bias (if any) contiguous float32 [n]. Returns x widened
// to fp32, contiguous (each kernel reads it as fp32 rows).
inline torch::Tensor checked_fp32_rows(const torch::Tensor& x, int64_t k, const std::optional<torch::Tensor>& bias,
                                       int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == k,
              "x must be bf16 [rows, K] with the weight's K");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                        "bias must be contiguous float32 [N]");
  return x.to(at::kFloat).contiguous();
}

}  // namespace pagedllm_avx2
