// Writes this step's K/V into their cache slots in the layout of kv_layout.h (slot -1 = padding, skipped); into
// an fp8 cache as e4m3 of value / scale, round to nearest even (c10's conversion, as torch's .to()), clamped.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "simd.h"

#include "kv_layout.h"
#include "ops.h"

namespace {

constexpr int64_t kMaxHeadDim = 256;

// One head's K or V values as cache elements, into `out` (head_dim of them): the same dtype as is; fp8 divided by
// the scale (a division, as torch's: a multiply by 1/scale may differ by an ulp), rounded and clamped 16 at a
// time (simd.h's to_e4m3_16, bit for bit torch's).
template <typename S, typename T>
struct ToCache {
  static void row(const S* x, int64_t n, float, T* out) { std::copy(x, x + n, out); }
};
template <typename S>
struct ToCache<S, c10::Float8_e4m3fn> {
  static void row(const S* x, int64_t n, float scale, c10::Float8_e4m3fn* out) {
    for (int64_t d = 0; d < n; d += 16) {  // head_dim is a multiple of 16 (checked)
      const __m128i codes = pagedllm::to_e4m3_16(_mm512_div_ps(pagedllm::load16(x + d), _mm512_set1_ps(scale)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), codes);
    }
  }
};

template <typename S, typename T>
void store(const S* k, const S* v, int64_t k_stride, int64_t v_stride, T* k_cache, T* v_cache,
           const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t block_size,
           float k_scale, float v_scale) {
  const int64_t run = block_size * head_dim;  // one (block, kv head)
  const int64_t run_bytes = run * static_cast<int64_t>(sizeof(T));
  auto one_token = [&](int64_t i) {
    const int64_t slot = slots[i];
    if (slot < 0) return;
    const int64_t block = slot / block_size, t = slot % block_size;
    // A token's K units are spread over its whole (block, head) K run, one 4-byte unit per cache line: request
    // every line first so the misses overlap instead of stalling store by store.
    for (int64_t h = 0; h < kv_heads; ++h) {
      const char* kr = reinterpret_cast<const char*>(k_cache + (block * kv_heads + h) * run);
      const char* vr = reinterpret_cast<const char*>(v_cache + (block * kv_heads + h) * run);
      for (int64_t off = 0; off < run_bytes; off += 64) _mm_prefetch(kr + off, _MM_HINT_T0);
      const int64_t v_first = pagedllm::v_offset<T>(t, 0, head_dim) * static_cast<int64_t>(sizeof(T));
      for (int64_t off = v_first; off < v_first + head_dim * 4; off += 64) _mm_prefetch(vr + off, _MM_HINT_T0);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      T* kr = k_cache + (block * kv_heads + h) * run;
      T* vr = v_cache + (block * kv_heads + h) * run;
      T ks[kMaxHeadDim], vs[kMaxHeadDim];
      ToCache<S, T>::row(k + i * k_stride + h * head_dim, head_dim, k_scale, ks);
      ToCache<S, T>::row(v + i * v_stride + h * head_dim, head_dim, v_scale, vs);
      for (int64_t d = 0; d < head_dim; ++d) {
        kr[pagedllm::k_offset<T>(t, d, block_size)] = ks[d];
        vr[pagedllm::v_offset<T>(t, d, head_dim)] = vs[d];
      }
    }
  };
  // Slots are distinct, so tokens can be written in parallel.
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads()) if (tokens >= 16)
  for (int64_t i = 0; i < tokens; ++i) one_token(i);
}

template <typename S>
void store_from(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                double k_scale, double v_scale) {
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2), block_size = k_cache.size(1);
  const S* kp = k.data_ptr<S>();
  const S* vp = v.data_ptr<S>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    store<S, c10::Float8_e4m3fn>(kp, vp, k.stride(0), v.stride(0), k_cache.data_ptr<c10::Float8_e4m3fn>(),
                                 v_cache.data_ptr<c10::Float8_e4m3fn>(), sp, tokens, kv_heads, head_dim, block_size,
                                 static_cast<float>(k_scale), static_cast<float>(v_scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == k.scalar_type(), "the cache must be k's dtype or float8_e4m3fn");
    store<S, S>(kp, vp, k.stride(0), v.stride(0), k_cache.data_ptr<S>(), v_cache.data_ptr<S>(), sp, tokens,
                kv_heads, head_dim, block_size, 1.0f, 1.0f);
  }
}

}  // namespace

// k, v [tokens, kv_heads, head_dim] (rows may be strided); caches [blocks, block_size, kv_heads, head_dim]
// contiguous, of k's dtype or float8_e4m3fn; slots [tokens] int64.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
              double k_scale, double v_scale) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "k and v must be [tokens, kv_heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim] matching k");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k and v must share a dtype, and so must the caches");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "one int64 slot per token");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "scales must be positive");
  TORCH_CHECK(k.size(2) % 16 == 0 && k.size(2) <= kMaxHeadDim, "head_dim must be a multiple of 16, at most 256");
  if (k.scalar_type() == at::kFloat) {
    store_from<float>(k, v, k_cache, v_cache, slots, k_scale, v_scale);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16, "dtype must be float32 or bfloat16");
    store_from<at::BFloat16>(k, v, k_cache, v_cache, slots, k_scale, v_scale);
  }
}
