// Decode attention for CPUs with AVX2 and FMA: each row's one new query token over its whole context, read in
// place through the row's block table from the torch backend's cache layout [blocks, block_size, KV heads, D]
// (no gather into padded copies), fp32 math. The cache holds q's dtype or e4m3 (the fp8 cache, widened through
// F16C; its per-tensor K and V scales fold into the score scale and the output's normalisation). One work item
// is a (row, KV head): its query heads' scores against every context token, an exact softmax over them, then
// the probability-weighted sum of the values.
// torch's SDPA took ~5 ms per layer for 8 decode rows of ~400 tokens in bf16 on the 2-core Zen 3 host.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pagedllm_avx2::load8;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// A cache row's 8 elements as fp32, times 1 / kv_unscale<C>() (e4m3 reads back scaled by 2^-8, simd.h).
inline __m256 load_kv8(const float* p) { return load8(p); }
inline __m256 load_kv8(const at::BFloat16* p) { return load8(p); }
inline __m256 load_kv8(const at::Float8_e4m3fn* p) { return pagedllm_avx2::load8_e4m3_div256(p); }
template <typename C>
constexpr float kv_unscale() { return std::is_same_v<C, at::Float8_e4m3fn> ? pagedllm_avx2::kE4m3Unscale : 1.0f; }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x for x <= 0 (scores minus their maximum): 2^n * 2^f, f in [-0.5, 0.5], degree-6 polynomial for 2^f
// (relative error < 2e-7); below -87 it is ~0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <typename T>
void store(T* out, const float* v, int64_t d, float inv) {
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(v[i] * inv);
}

// T: q's and the output's dtype; C: the cache's elements (T, or e4m3 with its scales k_scale and v_scale).
template <typename T, typename C>
void attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale, double k_scale,
            double v_scale, int64_t window, torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t token_stride = kv_heads * d, block_stride = block_size * token_stride;
  const int64_t table_stride = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const float q_scale = static_cast<float>(scale * k_scale) * kv_unscale<C>();
  const float out_scale = static_cast<float>(v_scale) * kv_unscale<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t chunks = d / 8;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), probs, acc(group * d), sums(group);  // reused by the thread's items
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kvh = item % kv_heads;
      const int64_t len = lens[row], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = tables + row * table_stride;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = to_float(qp[(row * heads + kvh * group + g) * d + i]) * q_scale;
      probs.assign(group * n + 8, 0.0f);  // [group][n], padded for the vector loop's tail
      // Each block's rows of this KV head: a constant stride apart (the prefetcher follows it); the next
      // block's rows are prefetched while this one's are used. Positions run from `first`; probs index j - first.
      auto for_each_token = [&](const C* cache, auto&& use) {
        const int64_t last_block = (len - 1) / block_size;
        for (int64_t b = first / block_size; b <= last_block; ++b) {
          const C* base = cache + table[b] * block_stride + kvh * d;
          if (b < last_block)
            for (int64_t t = 0; t < block_size; ++t)
              for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(C)); byte += 64)
                _mm_prefetch(reinterpret_cast<const char*>(cache + table[b + 1] * block_stride + kvh * d +
                                                           t * token_stride) + byte, _MM_HINT_T0);
          const int64_t t0 = b == first / block_size ? first % block_size : 0;
          const int64_t t1 = b == last_block ? (len - 1) % block_size + 1 : block_size;
          for (int64_t t = t0; t < t1; ++t) use(base + t * token_stride, b * block_size + t - first);
        }
      };
      // Scores: each key row loaded once for all the group's query heads.
      for_each_token(kp, [&](const C* kr, int64_t j) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * d;
          __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
          int64_t c = 0;
          for (; c + 1 < chunks; c += 2) {
            s0 = _mm256_fmadd_ps(load8(qg + 8 * c), load_kv8(kr + 8 * c), s0);
            s1 = _mm256_fmadd_ps(load8(qg + 8 * c + 8), load_kv8(kr + 8 * c + 8), s1);
          }
          if (c < chunks) s0 = _mm256_fmadd_ps(load8(qg + 8 * c), load_kv8(kr + 8 * c), s0);
          probs[g * n + j] = hsum(_mm256_add_ps(s0, s1));
        }
      });
      // Exact softmax per head (unnormalised here; the sum divides the output).
      for (int64_t g = 0; g < group; ++g) {
        float* p = probs.data() + g * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) top = std::max(top, p[j]);
        const __m256 m = _mm256_set1_ps(top);
        __m256 total = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
          _mm256_storeu_ps(p + j, e);
          total = _mm256_add_ps(total, e);
        }
        float sum = hsum(total);
        for (; j < n; ++j) {
          p[j] = std::exp(p[j] - top);
          sum += p[j];
        }
        sums[g] = sum;
      }
      // Values: each row loaded once for all the group's heads, accumulated in fp32.
      std::fill(acc.begin(), acc.end(), 0.0f);
      for_each_token(vp, [&](const C* vr, int64_t j) {
        for (int64_t c = 0; c < chunks; ++c) {
          const __m256 vv = load_kv8(vr + 8 * c);
          for (int64_t g = 0; g < group; ++g) {
            float* a = acc.data() + g * d + 8 * c;
            _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(probs[g * n + j]), vv, _mm256_loadu_ps(a)));
          }
        }
      });
      for (int64_t g = 0; g < group; ++g)
        store(op + (row * heads + kvh * group + g) * d, acc.data() + g * d, d, out_scale / sums[g]);
    }
  });
}

}  // namespace

torch::Tensor avx2_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                    int64_t window, double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [rows, heads, D], caches [blocks, block_size, KV heads, D]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || fp8) &&
              v_cache.scalar_type() == k_cache.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q must be float32 or bfloat16, the caches q's dtype or float8_e4m3fn");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) % 8 == 0 && q.size(1) % k_cache.size(2) == 0,
              "head dims must match and be a multiple of 8; query heads a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
              block_tables.size(0) >= q.size(0), "block_tables must be int64 [rows, blocks], rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() >= q.size(0),
              "seq_lens must be contiguous int64 [rows]");
  q = q.contiguous();
  torch::Tensor out = torch::empty_like(q);
  const bool f32 = q.scalar_type() == at::kFloat;
  if (fp8 && f32)
    attend<float, at::Float8_e4m3fn>(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window,
                                     out);
  else if (fp8)
    attend<at::BFloat16, at::Float8_e4m3fn>(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                                            window, out);
  else if (f32)
    attend<float, float>(q, k_cache, v_cache, block_tables, seq_lens, scale, 1.0, 1.0, window, out);
  else
    attend<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, 1.0, 1.0, window, out);
  return out;
}
