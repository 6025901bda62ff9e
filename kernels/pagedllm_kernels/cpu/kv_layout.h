// The CPU kernels' KV cache layout, shared by the KV store and the attention kernel.
//
// A layer's K cache (and V cache) keeps the engine's shape [blocks, block_size, kv_heads, head_dim], but inside
// a block the elements are arranged for the attention kernel's dot products, in 32-bit units of P elements
// (P = 2 for bf16, the pair one AVX512-BF16 dot-product lane consumes; P = 1 for fp32; an fp8 cache keeps
// bf16's arrangement, P = 2, in 16-bit units, since its elements are read as bf16 pairs):
//   K: [kv_heads][head_dim / P][block_size][P]  one unit of 16 consecutive tokens fills a vector, so a
//      query's scores for 16 tokens are one vector of dot products, with no horizontal sums;
//   V: [kv_heads][block_size / P][head_dim][P]  P consecutive tokens' values of one dim are one unit, so the
//      probability-weighted sum runs as dot products over token pairs.
// Each (block, kv head) is one contiguous run of block_size * head_dim elements in either cache.
#pragma once

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

namespace pagedllm {

template <typename T>
constexpr int kUnit = static_cast<int>(4 / sizeof(T));  // elements per 32-bit unit
template <>
constexpr int kUnit<c10::Float8_e4m3fn> = 2;  // bf16's pairs, one byte each

// Offsets of token t (within its block), dim d, inside one (block, kv head) run.
template <typename T>
inline int64_t k_offset(int64_t t, int64_t d, int64_t block_size) {
  constexpr int P = kUnit<T>;
  return ((d / P) * block_size + t) * P + d % P;
}
template <typename T>
inline int64_t v_offset(int64_t t, int64_t d, int64_t head_dim) {
  constexpr int P = kUnit<T>;
  return ((t / P) * head_dim + d) * P + t % P;
}

}  // namespace pagedllm
