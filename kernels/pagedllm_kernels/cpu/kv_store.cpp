// Writes this step's K/V into their cache slots in the layout of kv_layout.h (slot -1 = padding, skipped).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kv_layout.h"
#include "ops.h"

namespace {

template <typename T>
void store(const T* k, const T* v, int64_t k_stride, int64_t v_stride, T* k_cache, T* v_cache,
           const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
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
      const T* ks = k + i * k_stride + h * head_dim;
      const T* vs = v + i * v_stride + h * head_dim;
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

}  // namespace

// k, v [tokens, kv_heads, head_dim] (rows may be strided); caches [blocks, block_size, kv_heads, head_dim]
// contiguous; slots [tokens] int64.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "k and v must be [tokens, kv_heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim] matching k");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "one int64 slot per token");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2), block_size = k_cache.size(1);
  if (k.scalar_type() == at::kFloat) {
    store<float>(k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), v.stride(0), k_cache.data_ptr<float>(),
                 v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(), tokens, kv_heads, head_dim, block_size);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16, "dtype must be float32 or bfloat16");
    store<at::BFloat16>(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), k.stride(0), v.stride(0),
                        k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                        slots.data_ptr<int64_t>(), tokens, kv_heads, head_dim, block_size);
  }
}
