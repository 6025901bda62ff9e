// Weight-only int4 linears (AWQ, GPTQ) for CPUs with AVX2 and FMA but no AVX-512, on the weight as int4_layout.py
// packs it for every CPU kernel: [N/16, K/2, 16] bytes, input k's code in the low nibble and k + 1's in the high,
// scales and mins [N/16, G, 16] fp32, W[n, k] = s * code - min. Each pair of inputs of a 16-column tile is one
// 16-byte load, widened to four vectors of 8 fp32 weights (two columns halves x two inputs) with one FMA each,
// then used by up to 4 rows of x. Before this kernel an AVX2 host dequantized the whole weight in torch on every
// call and ran torch's bf16 matmul: 125M AWQ decoded at 0.05x the bf16 model's speed.
// Large batches are compute-bound: `avx2_int4_dequantize_tiles` writes the weight once per call as the bf16
// linear's tiles (bf16_linear.cpp), for that kernel to run.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <optional>
#include <utility>

namespace {

using pagedllm_avx2::to_bf16_8;

constexpr int kTile = 16;  // output columns per tile of the layout: two registers of fp32
constexpr int kRows = 4;   // rows of x per block: 8 sums, 4 weight vectors, the group's scales and mins

// One pair of inputs (k, k + 1) of a tile: w[0], w[1] = k's columns 0-7 and 8-15; w[2], w[3] = k + 1's.
struct PairWeights {
  __m256 w[4];
};
inline __m256 codes8(__m128i nibbles) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles)); }
inline PairWeights dequant_pair(const uint8_t* p, const float* s, const float* m) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
  const __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8);
  return {{_mm256_fmsub_ps(codes8(lo), s0, m0), _mm256_fmsub_ps(codes8(_mm_unpackhi_epi64(lo, lo)), s1, m1),
           _mm256_fmsub_ps(codes8(hi), s0, m0), _mm256_fmsub_ps(codes8(_mm_unpackhi_epi64(hi, hi)), s1, m1)}};
}

struct Args {
  const float* x;  // [rows, k] fp32
  const uint8_t* packed;
  const float *scales, *mins;  // [N/16, G, 16]
  const float* bias;  // [n] or null
  at::BFloat16* y;  // [rows, n]
  int64_t rows, k, n, group_size;
};

// Sums written out at compile time (fold expressions): with loops over arrays of __m256, GCC 12 at -O3 stores
// every sum to the stack each iteration (bf16_linear.cpp measured 4x slower). acc[r * 2 * U + u * 2 + h]:
// row r, half h of the tile; with U = 2, input k goes to u = 0 and k + 1 to u = 1 (independent chains for
// blocks of 1-2 rows), with U = 1 both go to the same sums.
template <int U, size_t... R>
inline void rows_fma(__m256* acc, const PairWeights& pw, const float* x, int64_t k, std::index_sequence<R...>) {
  auto one = [&](size_t r) __attribute__((always_inline)) {
    __m256* a = acc + r * 2 * U;
    const __m256 x0 = _mm256_broadcast_ss(x + r * k), x1 = _mm256_broadcast_ss(x + r * k + 1);
    a[0] = _mm256_fmadd_ps(pw.w[0], x0, a[0]);
    a[1] = _mm256_fmadd_ps(pw.w[1], x0, a[1]);
    a[2 * (U - 1)] = _mm256_fmadd_ps(pw.w[2], x1, a[2 * (U - 1)]);
    a[2 * (U - 1) + 1] = _mm256_fmadd_ps(pw.w[3], x1, a[2 * (U - 1) + 1]);
  };
  (one(R), ...);
}

template <int R, int U, size_t... J>
inline void store_rows(const __m256* acc, const float* bias, at::BFloat16* y, int64_t n, std::index_sequence<J...>) {
  auto one = [&](size_t j) __attribute__((always_inline)) {  // j = r * 2 + h
    const size_t r = j / 2, h = j % 2;
    __m256 sum = acc[r * 2 * U + h];
    if (U == 2) sum = _mm256_add_ps(sum, acc[r * 2 * U + 2 + h]);
    if (bias) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + h * 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * n + h * 8), to_bf16_8(sum));
  };
  (one(J), ...);
}

// Rows r0..r0+R-1 of y for tile t.
template <int R, int U>
void block(const Args& a, int64_t r0, int64_t t) {
  __m256 acc[R * 2 * U];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const int64_t groups = a.k / a.group_size, pairs_per_group = a.group_size / 2;
  const uint8_t* p = a.packed + t * (a.k / 2) * kTile;
  const float* x = a.x + r0 * a.k;
  for (int64_t g = 0; g < groups; ++g) {
    const float* s = a.scales + (t * groups + g) * kTile;
    const float* m = a.mins + (t * groups + g) * kTile;
    for (int64_t i = 0; i < pairs_per_group; ++i, p += kTile) {
      const int64_t k0 = (g * pairs_per_group + i) * 2;
      rows_fma<U>(acc, dequant_pair(p, s, m), x + k0, a.k, std::make_index_sequence<R>{});
    }
  }
  store_rows<R, U>(acc, a.bias ? a.bias + t * kTile : nullptr, a.y + r0 * a.n + t * kTile, a.n,
                   std::make_index_sequence<R * 2>{});
}

void rows_of(const Args& a, int64_t t) {
  int64_t r = 0;
  for (; r + kRows <= a.rows; r += kRows) block<kRows, 1>(a, r, t);
  switch (a.rows - r) {
    case 3: return block<3, 1>(a, r, t);
    case 2: return block<2, 2>(a, r, t);
    case 1: return block<1, 2>(a, r, t);
    default: return;
  }
}

void check_layout(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& mins,
                  int64_t group_size) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kTile &&
              packed.is_contiguous(), "packed must be contiguous uint8 [N/16, K/2, 16]");
  const int64_t k = packed.size(1) * 2;
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0,
              "group_size must be a multiple of 32 dividing K");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                t->size(0) == packed.size(0) && t->size(1) == k / group_size && t->size(2) == kTile,
                "scales and mins must be contiguous float32 [N/16, K/group_size, 16]");
}

}  // namespace

torch::Tensor avx2_int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                               int64_t group_size, std::optional<torch::Tensor> bias) {
  check_layout(packed, scales, mins, group_size);
  const int64_t n = packed.size(0) * kTile, k = packed.size(1) * 2;
  const torch::Tensor xf = pagedllm_avx2::checked_fp32_rows(x, k, bias, n);
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
  const Args a{xf.data_ptr<float>(), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
               bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), x.size(0), k, n, group_size};
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rows_of(a, t);
  });
  return y;
}

void avx2_int4_dequantize_tiles(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group_size,
                                torch::Tensor out) {
  check_layout(packed, scales, mins, group_size);
  const int64_t tiles = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 3 &&
              out.size(0) == tiles * 2 && out.size(1) == k && out.size(2) == 8,
              "out must be contiguous bf16 [N/8, K, 8] (the bf16 linear's tiles)");
  const int64_t groups = k / group_size, pairs_per_group = group_size / 2;
  const uint8_t* packed_p = packed.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *mp = mins.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      at::BFloat16* lo_cols = op + 2 * t * k * 8;  // columns 0-7 of the tile, [K, 8]
      at::BFloat16* hi_cols = lo_cols + k * 8;     // columns 8-15
      const uint8_t* p = packed_p + t * (k / 2) * kTile;
      for (int64_t g = 0; g < groups; ++g) {
        const float* s = sp + (t * groups + g) * kTile;
        const float* m = mp + (t * groups + g) * kTile;
        for (int64_t i = 0; i < pairs_per_group; ++i, p += kTile) {
          const int64_t k0 = (g * pairs_per_group + i) * 2;
          const PairWeights pw = dequant_pair(p, s, m);
          auto put = [](at::BFloat16* dst, __m256 v) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), to_bf16_8(v));
          };
          put(lo_cols + k0 * 8, pw.w[0]);
          put(hi_cols + k0 * 8, pw.w[1]);
          put(lo_cols + (k0 + 1) * 8, pw.w[2]);
          put(hi_cols + (k0 + 1) * 8, pw.w[3]);
        }
      }
    }
  });
}
