// KV store into an fp8 (e4m3) cache for CPUs with AVX2 but no AVX-512, in the torch backend's cache layout
// [blocks, block_size, KV heads, D]: each token's K / k_scale and V / v_scale rounded to e4m3 (round_to_e4m3,
// torch's .to(float8_e4m3fn) of the clamped values) and written as codes into its slot, in one pass; torch
// takes a widening, a division, a clamp, a conversion and an indexed copy. Slot -1 (padding) is skipped.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

namespace {

template <typename S, typename Slot>
void store(const S* k, const S* v, int64_t k_token, int64_t k_head, int64_t v_token, int64_t v_head,
           uint8_t* k_cache, uint8_t* v_cache, const Slot* slots, int64_t tokens, int64_t heads, int64_t d,
           float k_scale, float v_scale) {
  const __m256 ks = _mm256_set1_ps(k_scale), vs = _mm256_set1_ps(v_scale);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        uint8_t* kd = k_cache + (slot * heads + h) * d;
        uint8_t* vd = v_cache + (slot * heads + h) * d;
        const S* kx = k + t * k_token + h * k_head;
        const S* vx = v + t * v_token + h * v_head;
        for (int64_t i = 0; i < d; i += 8) {  // divided, as torch does (not times 1 / scale)
          const __m256 kq = pagedllm_avx2::round_to_e4m3(_mm256_div_ps(pagedllm_avx2::load8(kx + i), ks));
          const __m256 vq = pagedllm_avx2::round_to_e4m3(_mm256_div_ps(pagedllm_avx2::load8(vx + i), vs));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(kd + i), pagedllm_avx2::e4m3_codes8(kq));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(vd + i), pagedllm_avx2::e4m3_codes8(vq));
        }
      }
    }
  });
}

template <typename S>
void store_source(const torch::Tensor& k, const torch::Tensor& v, uint8_t* kc, uint8_t* vc,
                  const torch::Tensor& slots, float k_scale, float v_scale) {
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  if (slots.scalar_type() == at::kLong)
    store(k.data_ptr<S>(), v.data_ptr<S>(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc, vc,
          slots.data_ptr<int64_t>(), tokens, heads, d, k_scale, v_scale);
  else
    store(k.data_ptr<S>(), v.data_ptr<S>(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc, vc,
          slots.data_ptr<int32_t>(), tokens, heads, d, k_scale, v_scale);
}

}  // namespace

void avx2_store_kv_fp8(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slots, double k_scale, double v_scale) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat),
              "k and v must be bf16 or fp32 [tokens, KV heads, D] of one shape");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.size(2) % 8 == 0,
              "k and v need a contiguous head dim, a multiple of 8");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat8_e4m3fn && v_cache.scalar_type() == at::kFloat8_e4m3fn &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "the caches must be contiguous float8_e4m3fn [blocks, block_size, KV heads, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.is_contiguous() &&
                  (slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt),
              "slots must be contiguous int64 or int32 [tokens]");
  auto* kc = reinterpret_cast<uint8_t*>(k_cache.data_ptr());
  auto* vc = reinterpret_cast<uint8_t*>(v_cache.data_ptr());
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  if (k.scalar_type() == at::kBFloat16)
    store_source<at::BFloat16>(k, v, kc, vc, slots, ks, vs);
  else
    store_source<float>(k, v, kc, vc, slots, ks, vs);
}
