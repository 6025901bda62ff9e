// AVX-512 helpers shared by the CPU kernels.
#pragma once

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

namespace pagedllm {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 2^t (t >= -126 taken; inf above 128): 2^n * q(f), n = round(t), f in [-0.5, 0.5], q the Taylor polynomial of
// 2^f of degree 6 (relative error < 2e-7).
inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// e^x (inf above ~88, ~1e-38 below -87): 2^(x log2 e) at degree 6.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  return exp2_16(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)));
}

// 2^t in the lanes of keep (0 in the others, whatever t holds) to 7.5e-5 relative error, enough for weights
// rounded to bf16 next: f = t - floor(t) in [0, 1) (vreduceps, AVX512-DQ), p(f) the degree-3 minimax polynomial
// of 2^f there (fitted for relative error by reweighted least squares), times 2^floor(t) (vscalefps floors
// its exponent itself; below -149 the result is 0). Against exp2_16 above: no clamp, no separate round and
// subtract, three FMAs instead of six, and the lane mask folded into the scale: the attention softmax's exp.
inline __m512 exp2_16_coarse(__mmask16 keep, __m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(7.802403102608275e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606707273038262e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958339921071446e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251255464457e-1f));
  return _mm512_maskz_scalef_ps(keep, p, t);
}

// fp32 -> bf16, round to nearest even (what torch's .to(bfloat16) does), 16 values.
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
}

// The value a bf16 tensor op would hold: x rounded to T (a no-op for fp32).
inline __m512 round_to(const float*, __m512 x) { return x; }
inline __m512 round_to(const at::BFloat16*, __m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

// e4m3 (float8_e4m3fn) codes 0..127 (sign clear) as bf16 bits: every e4m3 value, subnormals and 448 included,
// is a bf16 exactly. Code 0x7f (NaN) is never stored: the store clamps to +-448.
constexpr uint16_t e4m3_bf16_bits(int code) {
  const int e = code >> 3, m = code & 7;
  if (code == 0x7f) return 0x7fc0;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));  // 2^(e-7) * (1 + m/8)
  if (m == 0) return 0;
  const int top = m >= 4 ? 2 : (m >= 2 ? 1 : 0);  // m * 2^-9 = 2^(top-9) * (m / 2^top)
  return static_cast<uint16_t>(((top - 9 + 127) << 7) | ((m - (1 << top)) << (7 - top)));
}
// The bf16 bits' low and high bytes of e4m3 codes 0..127, as two 128-byte tables (two vectors each).
struct E4m3ByteTables {
  alignas(64) uint8_t low[128];
  alignas(64) uint8_t high[128];
  constexpr E4m3ByteTables() : low(), high() {
    for (int c = 0; c < 128; ++c) {
      low[c] = static_cast<uint8_t>(e4m3_bf16_bits(c) & 0xff);
      high[c] = static_cast<uint8_t>(e4m3_bf16_bits(c) >> 8);
    }
  }
};
inline constexpr E4m3ByteTables kE4m3Bytes{};

// Up to 64 e4m3 codes (bytes) -> their bf16 values' low and high bytes: one 128-entry byte lookup (vpermi2b
// reads the low 7 bits, the magnitude) for each, and the sign bit copied from the code into the high byte.
inline void e4m3_bf16_bytes(__m512i codes, __m512i& low, __m512i& high) {
  const __m512i* lo = reinterpret_cast<const __m512i*>(kE4m3Bytes.low);
  const __m512i* hi = reinterpret_cast<const __m512i*>(kE4m3Bytes.high);
  low = _mm512_permutex2var_epi8(_mm512_load_si512(lo), codes, _mm512_load_si512(lo + 1));
  high = _mm512_permutex2var_epi8(_mm512_load_si512(hi), codes, _mm512_load_si512(hi + 1));
  high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8(-0x80), 0xF8);  // high | (codes & 0x80)
}

// Byte indices that interleave low[i], high[i] into 16-bit element i, for i in [32 * half, 32 * half + 32).
inline __m512i interleave_index(int half) {
  alignas(64) static constexpr auto kIndex = [] {
    struct { uint8_t v[2][64]; } ix{};
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 32; ++i) {
        ix.v[h][2 * i] = static_cast<uint8_t>(32 * h + i);            // from low (bit 6 clear)
        ix.v[h][2 * i + 1] = static_cast<uint8_t>(64 + 32 * h + i);   // from high
      }
    return ix;
  }();
  return _mm512_load_si512(kIndex.v[half]);
}

// 32 e4m3 bytes -> 32 bf16 of the same values (three byte shuffles and a ternary op).
inline __m512 fp8x32_to_bf16(const c10::Float8_e4m3fn* p) {
  __m512i low, high;
  e4m3_bf16_bytes(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), low, high);
  return _mm512_castsi512_ps(_mm512_permutex2var_epi8(low, interleave_index(0), high));
}

// 64 e4m3 bytes -> their first 32 and last 32 as bf16 (four byte shuffles and a ternary op, where two calls of
// the above take twice that).
inline void fp8x64_to_bf16(const c10::Float8_e4m3fn* p, __m512& first, __m512& second) {
  __m512i low, high;
  e4m3_bf16_bytes(_mm512_loadu_si512(p), low, high);
  first = _mm512_castsi512_ps(_mm512_permutex2var_epi8(low, interleave_index(0), high));
  second = _mm512_castsi512_ps(_mm512_permutex2var_epi8(low, interleave_index(1), high));
}

// 16 fp32 (already divided by the scale) -> 16 e4m3 bytes, round to nearest even, clamped to +-448 (torch's
// .to(float8_e4m3fn) of the clamped values, bit for bit). Normal range: the fp32 rounded at mantissa bit 20,
// its exponent rebiased (127 -> 7); below 2^-6, the subnormal code is round(|x| * 2^9).
inline __m128i to_e4m3_16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x80000000)), 24);
  const __m512 a = _mm512_abs_ps(x);
  const __m512i ab = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(small, normal, sub), sign);
  return _mm512_cvtepi32_epi8(code);
}

}  // namespace pagedllm
