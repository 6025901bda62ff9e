// The parts of the paged attention kernel (paged_attention.cpp) that its AVX-512 path and its AMX prompt-tile
// path (attention_amx.h) share: the work item, the live-lane masks, fp8 widening, and the online softmax step.
#pragma once

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace pagedllm::attention {

// One work item: tokens t0..t1-1 of a row (its last tokens: token t sees the row's first
// len - (n - 1 - t) positions, n the row's token count) and the KV heads k0..k1-1 (contiguous in every block),
// with every query head reading those KV heads. Its query vectors ("slots") share each block's K/V run while
// it is in cache: a prompt's tokens are attended a tile at a time, not each over its whole prefix again.
struct Item {
  int64_t row, t0, t1, k0, k1;
};

// Lanes i of the 16-position chunk at c whose position c + i lies in [a, b).
inline __mmask16 live_lanes(int64_t c, int64_t a, int64_t b) {
  const int64_t lo = std::max<int64_t>(a - c, 0), hi = std::min<int64_t>(b - c, 16);
  if (hi <= lo) return 0;  // (a tile's slot may have no live position in a block: b < a)
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// An fp8 run's n elements (a multiple of 64) as bf16 of the same values, in the same order.
inline void widen_run(const c10::Float8_e4m3fn* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) {
    __m512 a, b;
    pagedllm::fp8x64_to_bf16(src + i, a, b);
    _mm512_store_ps(reinterpret_cast<float*>(dst + i), a);
    _mm512_store_ps(reinterpret_cast<float*>(dst + i + 32), b);
  }
}

// Positions per block the kernel takes (block sizes 16, 32, 48 or 64).
constexpr int kMaxBlock = 64;

// One query vector's online-softmax step over the unscaled scores of positions [c0, b) (16-position chunks
// from a 16-aligned c0), of which [aj, bj) are live: its running max, the D = 16 * CH accumulators and the 16
// partial sums of its denominator are rescaled where the max grows, and probs[c0, roundup16(b)) gets
// exp(score * scale - max) in T's precision (0 outside [aj, bj), whatever the score: the cache may hold
// anything there, even NaN).
template <typename T, int CH>
inline void online_softmax_step(const float* scores, T* probs, int64_t c0, int64_t b, int64_t aj, int64_t bj,
                                float scale, float& running_max, float* denom, float* acc) {
  auto live = [aj, bj](int64_t c) -> __mmask16 { return c >= aj && c + 16 <= bj ? 0xFFFF : live_lanes(c, aj, bj); };
  // Horizontal reductions are the costly part: the lane-wise max is reduced only when some lane exceeds the
  // running max, and the denominator is kept as 16 partial sums until the end. The max is taken unscaled
  // (scale > 0: the same as the scaled scores' max).
  __m512 lane_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = c0; c < b; c += 16)
    lane_max = _mm512_mask_max_ps(lane_max, live(c), lane_max, _mm512_load_ps(scores + c));
  lane_max = _mm512_mul_ps(lane_max, _mm512_set1_ps(scale));
  if (_mm512_cmp_ps_mask(lane_max, _mm512_set1_ps(running_max), _CMP_GT_OQ)) {
    const float block_max = _mm512_reduce_max_ps(lane_max);
    const __m512 rescale = _mm512_set1_ps(std::exp(running_max - block_max));
    _mm512_store_ps(denom, _mm512_mul_ps(_mm512_load_ps(denom), rescale));
    for (int c = 0; c < CH; ++c) _mm512_store_ps(acc + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), rescale));
    running_max = block_max;
  }
  // exp(s * scale - max) as 2^(s * scale * log2(e) - max * log2(e)): one FMA before the polynomial, the coarse
  // one where the weights are rounded to bf16 next (simd.h).
  constexpr float kLog2e = 1.4426950408889634f;
  const __m512 k = _mm512_set1_ps(scale * kLog2e), m = _mm512_set1_ps(running_max * kLog2e);
  __m512 sum = _mm512_load_ps(denom);
  // A lane outside [aj, bj) is 0, whatever its score (a slot with no live lane keeps a -inf max).
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t c = c0; c < b; c += 16) {
      const __m512 t = _mm512_fmsub_ps(_mm512_load_ps(scores + c), k, m);
      const __m512 p = _mm512_maskz_mov_ps(live(c), pagedllm::exp2_16(t));
      _mm512_store_ps(probs + c, p);
      sum = _mm512_add_ps(sum, p);
    }
  } else {
    // Rounded to bf16 first, so the denominator sums exactly the weights the values get: two chunks' weights
    // packed into one vector, summed in pairs by a bf16 dot product with ones (exact products, fp32 sums).
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int64_t c = c0; c < b; c += 32) {
      const __m512 p0 = pagedllm::exp2_16_coarse(live(c), _mm512_fmsub_ps(_mm512_load_ps(scores + c), k, m));
      const bool two = c + 16 < b;
      const __m512 p1 =
          two ? pagedllm::exp2_16_coarse(live(c + 16), _mm512_fmsub_ps(_mm512_load_ps(scores + c + 16), k, m))
              : _mm512_setzero_ps();
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0's weights in the low half
      if (two)
        _mm512_storeu_si512(probs + c, h);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + c), _mm512_castsi512_si256(h));
      sum = _mm512_dpbf16_ps(sum, (__m512bh)h, ones);
    }
  }
  _mm512_store_ps(denom, sum);
}

// A query vector's output: its accumulators over its denominator (times the cache's value scale).
template <typename T, int CH>
inline void write_output(T* o, const float* acc, const float* denom, float v_scale) {
  const float sum = _mm512_reduce_add_ps(_mm512_load_ps(denom));
  const __m512 inv = _mm512_set1_ps(sum > 0.0f ? v_scale / sum : 0.0f);
  for (int c = 0; c < CH; ++c) pagedllm::store16(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), inv));
}

}  // namespace pagedllm::attention
