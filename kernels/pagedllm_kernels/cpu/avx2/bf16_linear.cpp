// bf16 linears for CPUs with AVX2 and FMA but no AVX-512 (Zen 3, Haswell to Skylake client parts), where
// oneDNN has no bf16 matmul and torch's bf16 F.linear runs at ~15 GFLOP/s. The weight is kept in bf16, in tiles
// of 8 output columns ([N/8, K, 8], avx2_linear.py): one 16-byte load per tile and input position widens to the
// 8 columns' fp32 weights, each broadcast x value feeds 2 tiles, and 6 rows of x share every weight vector
// (12 fp32 accumulators of the 16 registers). x is widened to fp32 once; sums are fp32, rounded to bf16 once
// (round to nearest even, as torch's .to(bfloat16)). On the 2-core Zen 3 host, over the 125M model's 49 linears
// (perf/avx2_kernels.py): 1.3x torch's bf16 F.linear at 1 row, 4.7x at 8, 6.5-7x at 32-256 (100-122 GFLOP/s);
// and faster at every batch up to 2,048 rows than widening the weight to fp32 for MKL's sgemm (12 layers).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <optional>
#include <utility>

namespace {

using pagedllm_avx2::load8;
using pagedllm_avx2::to_bf16_8;

constexpr int kCols = 8;   // output columns per tile: one register of fp32
constexpr int kRows = 6;   // rows of x per register block
constexpr int kTiles = 2;  // tiles per work item: each broadcast of x feeds both

struct Args {
  const float* x;  // [rows, k] fp32
  const at::BFloat16* w;  // [n / 8, k, 8]
  const float* bias;  // [n] or null
  at::BFloat16* y;  // [rows, y_stride]
  int64_t rows, k, y_stride;
};

// acc[r * T + t] += w[t] * x[r * k] for r < R, t < T, written out at compile time (fold expressions) so that
// every sum has a constant index. With loops over arrays of __m256, GCC 12 at -O3 kept the sums in registers but
// also stored all of them to the stack on every iteration (measured 4x slower).
template <int T, size_t... I>
inline void row_fma(__m256* acc, const __m256* wv, __m256 xb, std::index_sequence<I...>) {
  ((acc[I] = _mm256_fmadd_ps(wv[I], xb, acc[I])), ...);
}
template <int T, size_t... R>
inline void rows_fma(__m256* acc, const __m256* wv, const float* x, int64_t k, std::index_sequence<R...>) {
  (row_fma<T>(acc + R * T, wv, _mm256_broadcast_ss(x + R * k), std::make_index_sequence<T>{}), ...);
}
// Input position i: T weight vectors widened, each x value broadcast once and used for every tile.
template <int R, int T>
inline void step(__m256* acc, const at::BFloat16* w, const float* x, int64_t k, int64_t i) {
  __m256 wv[T];
  for (int t = 0; t < T; ++t) wv[t] = load8(w + (t * k + i) * kCols);
  rows_fma<T>(acc, wv, x + i, k, std::make_index_sequence<R>{});
}
// U consecutive positions, each into its own set of sums.
template <int R, int T, size_t... U>
inline void steps(__m256 (*acc)[R * T], const at::BFloat16* w, const float* x, int64_t k, int64_t i,
                  std::index_sequence<U...>) {
  (step<R, T>(acc[U], w, x, k, i + U), ...);
}

// y's R x T vectors of 8: the U sums of each added, the bias, rounded to bf16 (unrolled like the FMAs: one loop
// over the sums here was enough for GCC to keep storing them on every iteration).
template <int R, int T, int U, size_t... J>
inline void store_all(__m256 (*acc)[R * T], const float* bias, at::BFloat16* y, int64_t y_stride,
                      std::index_sequence<J...>) {
  auto one = [&](size_t j) __attribute__((always_inline)) {
    const int64_t r = j / T, t = j % T;
    __m256 sum = acc[0][j];
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[u][j]);
    if (bias) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + t * kCols));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * y_stride + t * kCols), to_bf16_8(sum));
  };
  (one(J), ...);
}

// Rows r0..r0+R-1 of y for tiles t0..t0+T-1, over U interleaved runs of input positions: U * R * T independent
// sums, so that a decode's single row still keeps both FMA units busy.
template <int R, int T, int U>
void block(const float* __restrict x, const at::BFloat16* __restrict w, int64_t k, const float* bias,
           at::BFloat16* y, int64_t y_stride) {
  __m256 acc[U][R * T];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < R * T; ++j) acc[u][j] = _mm256_setzero_ps();
  const int64_t main = k - k % U;
  int64_t i = 0;
  for (; i < main; i += U) steps<R, T>(acc, w, x, k, i, std::make_index_sequence<U>{});
  for (; i < k; ++i) step<R, T>(acc[0], w, x, k, i);
  store_all<R, T, U>(acc, bias, y, y_stride, std::make_index_sequence<R * T>{});
}

// Rows r0..r0+R-1 with as many interleaved runs as 12 accumulators allow.
template <int R, int T>
void block(const Args& a, int64_t r0, int64_t t0) {
  constexpr int U = 12 / (R * T) > 4 ? 4 : (12 / (R * T) > 1 ? 12 / (R * T) : 1);
  block<R, T, U>(a.x + r0 * a.k, a.w + t0 * a.k * kCols, a.k, a.bias ? a.bias + t0 * kCols : nullptr,
                 a.y + r0 * a.y_stride + t0 * kCols, a.y_stride);
}

template <int T>
void rows_of(const Args& a, int64_t t0) {
  int64_t r = 0;
  for (; r + kRows <= a.rows; r += kRows) block<kRows, T>(a, r, t0);
  switch (a.rows - r) {
    case 5: return block<5, T>(a, r, t0);
    case 4: return block<4, T>(a, r, t0);
    case 3: return block<3, T>(a, r, t0);
    case 2: return block<2, T>(a, r, t0);
    case 1: return block<1, T>(a, r, t0);
    default: return;
  }
}

void check_tiles(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.size(2) == kCols && w.is_contiguous(),
              "weight tiles must be contiguous bf16 [N/8, K, 8]");
}

}  // namespace

torch::Tensor avx2_bf16_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  check_tiles(w);
  const int64_t n = w.size(0) * kCols;
  const torch::Tensor xf = pagedllm_avx2::checked_fp32_rows(x, w.size(1), bias, n);
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
  const Args a{xf.data_ptr<float>(), w.data_ptr<at::BFloat16>(), bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<at::BFloat16>(), x.size(0), x.size(1), n};
  const int64_t tiles = w.size(0), items = (tiles + kTiles - 1) / kTiles;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t0 = item * kTiles;
      if (t0 + kTiles <= tiles) rows_of<kTiles>(a, t0);
      else rows_of<1>(a, t0);
    }
  });
  return y;
}
