// Paged decode attention for CPUs with AVX-512 (and AVX512-BF16): one query token per row, K/V read in place
// through the block table (no gather), online softmax over blocks, fp32 accumulation, bf16 or fp32 cache.
// Parallel over rows; within a row, block by block, every KV head and the query heads that share it (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <limits>

namespace {

using pagedllm::exp16;
using pagedllm::load16;

constexpr int kMaxHeads = 128;  // query heads per row

// r[i] = sum of the lanes of v[i]: a transpose-and-add tree (15 adds) instead of 16 horizontal reductions.
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // z holds the sums in the order 0, 4, 8, 12, 1, 5, ...; put sum i in lane i.
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

// Dot products of one query head with 16 tokens' keys (lanes past `m` are 0): unscaled scores.
// fp32 cache: FMAs on fp32. bf16 cache: AVX512-BF16 dot-product instructions on the bf16 values as stored
// (products of two bf16 are exact in fp32, sums in fp32, as SDPA's bf16 path does) with no conversion.
template <int CH>
inline __m512 scores16(const float* q, const float* kb, int64_t token_stride, int64_t m) {
  __m512 qv[CH], dots[16];
  for (int c = 0; c < CH; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int t = 0; t < 16; ++t) {
    if (t >= m) { dots[t] = _mm512_setzero_ps(); continue; }
    const float* kt = kb + t * token_stride;
    __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
    for (int c = 1; c < CH; ++c) d = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), d);
    dots[t] = d;
  }
  return hsum16(dots);
}

template <int CH>
inline __m512 scores16(const at::BFloat16* q, const at::BFloat16* kb, int64_t token_stride, int64_t m) {
  constexpr int P = CH / 2;  // 32-element chunks
  __m512bh qv[P];
  __m512 dots[16];
  for (int c = 0; c < P; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  if (m == 16) {  // the common case, without a branch per token (keeps dots[] in registers)
    for (int t = 0; t < 16; ++t) {
      const at::BFloat16* kt = kb + t * token_stride;
      __m512 d = _mm512_setzero_ps();
      for (int c = 0; c < P; ++c) d = _mm512_dpbf16_ps(d, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
      dots[t] = d;
    }
    return hsum16(dots);
  }
  for (int t = 0; t < 16; ++t) {
    if (t >= m) { dots[t] = _mm512_setzero_ps(); continue; }
    const at::BFloat16* kt = kb + t * token_stride;
    __m512 d = _mm512_setzero_ps();
    for (int c = 0; c < P; ++c) d = _mm512_dpbf16_ps(d, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
    dots[t] = d;
  }
  return hsum16(dots);
}

// CH = head_dim / 16 is a compile-time constant so that queries, partial dot products and the output
// accumulators live in registers. One work item per row; inside it, block by block and KV head by KV head:
// a block's K (and V) rows hold all KV heads side by side, so they are read front to back once. The G query
// heads sharing a KV head are served from one pass over its values (each V vector is converted once).
template <typename T, int CH>
void decode_rows(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                 const int64_t* seq_lens, float* out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                 int64_t block_size, int64_t table_stride, int64_t block_stride, int64_t token_stride, float scale,
                 int64_t window) {
  constexpr int64_t D = 16 * CH;
  constexpr int GB = 4;  // query heads whose accumulators are held in registers at once
  const int64_t group = num_heads / num_kv_heads;  // query heads reading one KV head
  auto one_row = [&](int64_t row) {
    alignas(64) float acc[kMaxHeads][D];  // unnormalised outputs
    alignas(64) float probs[kMaxHeads][64 + 16];  // exp(score - running max) of the block's tokens
    float running_max[kMaxHeads], denom[kMaxHeads];
    const int64_t len = seq_lens[row];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const T* qrow = q + row * num_heads * D;
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int c = 0; c < CH; ++c) _mm512_store_ps(acc[h] + 16 * c, _mm512_setzero_ps());
      running_max[h] = -std::numeric_limits<float>::infinity();
      denom[h] = 0.0f;
    }
    const int64_t* table = block_tables + row * table_stride;
    for (int64_t start = first - first % block_size; start < len; start += block_size) {
      const int64_t block = table[start / block_size];
      const int64_t lo = std::max(start, first), n = std::min(start + block_size, len) - lo;
      const T* kblock = k_cache + block * block_stride + (lo - start) * token_stride;
      const T* vblock = v_cache + block * block_stride + (lo - start) * token_stride;
      if (start + block_size < len) {  // blocks are scattered: request the next one while this one computes
        const char* kn = reinterpret_cast<const char*>(k_cache + table[start / block_size + 1] * block_stride);
        const char* vn = reinterpret_cast<const char*>(v_cache + table[start / block_size + 1] * block_stride);
        for (int64_t off = 0; off < block_stride * static_cast<int64_t>(sizeof(T)); off += 64) {
          _mm_prefetch(kn + off, _MM_HINT_T0);
          _mm_prefetch(vn + off, _MM_HINT_T0);
        }
      }
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t0 = 0; t0 < n; t0 += 16) {  // scores (16 tokens at a time) and their max
            const int64_t m = std::min<int64_t>(16, n - t0);
            const __m512 sv = _mm512_mul_ps(
                scores16<CH>(qrow + h * D, kblock + t0 * token_stride + kvh * D, token_stride, m),
                _mm512_set1_ps(scale));
            block_max = std::max(block_max, _mm512_mask_reduce_max_ps(static_cast<__mmask16>((1u << m) - 1u), sv));
            _mm512_storeu_ps(probs[h] + t0, sv);
          }
          if (block_max > running_max[h]) {  // online softmax: rescale what was accumulated to the new max
            const float rescale = std::exp(running_max[h] - block_max);
            denom[h] *= rescale;
            for (int c = 0; c < CH; ++c)
              _mm512_store_ps(acc[h] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * c),
                                                             _mm512_set1_ps(rescale)));
            running_max[h] = block_max;
          }
          for (int64_t t0 = 0; t0 < n; t0 += 16) {  // probabilities exp(score - max), 0 past the block's end
            const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - t0)) - 1u);
            const __m512 sv = _mm512_loadu_ps(probs[h] + t0);
            const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(running_max[h]))));
            denom[h] += _mm512_reduce_add_ps(p);
            _mm512_storeu_ps(probs[h] + t0, p);
          }
        }
        // Values: up to GB query heads at a time, their accumulators in registers.
        for (int64_t h0 = kvh * group; h0 < (kvh + 1) * group; h0 += GB) {
          const int gn = static_cast<int>(std::min<int64_t>(GB, (kvh + 1) * group - h0));
          __m512 a[GB][CH];
          for (int g = 0; g < GB; ++g)
            if (g < gn)
              for (int c = 0; c < CH; ++c) a[g][c] = _mm512_load_ps(acc[h0 + g] + 16 * c);
          for (int64_t t = 0; t < n; ++t) {
            const T* vt = vblock + t * token_stride + kvh * D;
            __m512 vv[CH];
            for (int c = 0; c < CH; ++c) vv[c] = load16(vt + 16 * c);
            for (int g = 0; g < GB; ++g) {
              if (g >= gn) break;
              const __m512 p = _mm512_set1_ps(probs[h0 + g][t]);
              for (int c = 0; c < CH; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
            }
          }
          for (int g = 0; g < GB; ++g)
            if (g < gn)
              for (int c = 0; c < CH; ++c) _mm512_store_ps(acc[h0 + g] + 16 * c, a[g][c]);
        }
      }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      float* o = out + (row * num_heads + h) * D;
      const __m512 inv = _mm512_set1_ps(denom[h] > 0.0f ? 1.0f / denom[h] : 0.0f);
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * c), inv));
    }
  };
  // Rows differ in length by up to the context length (decode rows come sorted by it, and a prefill row's
  // tokens grow along it): hand them out one at a time, not in equal contiguous ranges.
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t row = 0; row < num_rows; ++row) one_row(row);
}

template <typename T>
void dispatch_head_dim(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens, float* out,
                       int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t table_stride, int64_t block_stride, int64_t token_stride, float scale, int64_t window) {
#define PAGEDLLM_CASE(CH)                                                                                   \
  case 16 * CH:                                                                                             \
    return decode_rows<T, CH>(q, k, v, tables, lens, out, rows, heads, kv_heads, block_size, table_stride,   \
                              block_stride, token_stride, scale, window);
  switch (head_dim) {
    PAGEDLLM_CASE(2)
    PAGEDLLM_CASE(4)
    PAGEDLLM_CASE(6)
    PAGEDLLM_CASE(8)
    default:
      TORCH_CHECK(false, "head_dim must be 32, 64, 96 or 128, got ", head_dim);
  }
#undef PAGEDLLM_CASE
}

}  // namespace

// q [rows, H, D]; k_cache, v_cache [blocks, block_size, KVH, D] (contiguous); block_tables [rows, max_blocks]
// int64; seq_lens [rows] int64 (context length including the query token); window <= 0: none.
// Returns fp32 [rows, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [rows, heads, head_dim] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "block_tables and seq_lens must be int64 (block_tables row-major)");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "q and the cache disagree on head_dim");
  TORCH_CHECK(heads % kv_heads == 0 && heads <= kMaxHeads, "heads must be a multiple of kv_heads, at most 128");
  TORCH_CHECK(block_size <= 64, "block_size must be <= 64");
  TORCH_CHECK(block_tables.size(0) == rows && seq_lens.size(0) == rows, "one block table and length per row");
  auto out = torch::empty({rows, heads, head_dim}, q.options().dtype(at::kFloat));
  const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                             block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                             rows, heads, kv_heads, head_dim, block_size, block_tables.stride(0), block_stride,
                             token_stride, static_cast<float>(scale), window);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "dtype must be float32 or bfloat16");
    dispatch_head_dim<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                    v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int64_t>(),
                                    seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), rows, heads, kv_heads,
                                    head_dim, block_size, block_tables.stride(0), block_stride, token_stride,
                                    static_cast<float>(scale), window);
  }
  return out;
}
