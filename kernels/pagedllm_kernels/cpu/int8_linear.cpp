// W8A8 int8 linear on AVX512-VNNI CPUs: y = (x quantized per row) (W quantized per column)^T, int32 sums.
//
// The weight (int8_linear.py): int8 per output column, scale s_w[n] = max |W[n, :]| / 127, laid out per tile of
// 16 columns and quad of input rows as 64 bytes (column j's 4 values side by side), so one vpdpbusd multiplies
// 16 columns x 4 inputs by a broadcast quad of x. Each row of x is quantized here, per row (dynamic per-token
// scale s_x[m] = max |x[m, :]| / 127, round to nearest even), and offset by 128 into the unsigned operand
// vpdpbusd takes; the offset's share, 128 * sum_k w[n, k], is taken off each column's sum:
//   y[m, n] = s_x[m] * s_w[n] * (sum_k (x8[m, k] + 128) w8[n, k] - 128 * wsum[n]) + b[n].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

constexpr int kTile = 16;
constexpr int kRowBlock = 8;

// Row m of x -> K unsigned bytes (x8 + 128) and its scale.
template <typename T>
void quantize_row(const T* x, int64_t k, uint8_t* out, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(pagedllm::load16(x + i)));
  const float m = _mm512_reduce_max_ps(amax);
  const float s = m > 0 ? m / 127.0f : 1.0f;
  *scale = s;
  const __m512 inv = _mm512_set1_ps(1.0f / s);
  for (int64_t i = 0; i < k; i += 16) {
    const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(pagedllm::load16(x + i), inv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i u = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                                        _mm512_set1_epi32(-127)), _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(u));
  }
}

struct Args {
  const uint8_t* xq;  // [rows, K]
  const float* xs;    // [rows]
  int64_t k;
  const int8_t* w;    // [N/16, K/4, 16, 4]
  const float* ws;    // [N]
  const int32_t* wsum;  // [N]
  const float* bias;  // [N] or nullptr
};

template <typename T, int R>
void tile_rows(const Args& a, int64_t tile, int64_t r0, T* y, int64_t y_stride) {
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  const int8_t* w = a.w + tile * a.k * kTile;
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * a.k);
  for (int64_t q = 0; q < a.k / 4; ++q) {
    const __m512i wv = _mm512_loadu_si512(w + q * 64);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(xr[r][q]), wv);
  }
  const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(a.wsum + tile * kTile), 7);  // 128 * wsum
  const __m512 ws = _mm512_loadu_ps(a.ws + tile * kTile);
  const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + tile * kTile) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], off));
    const __m512 out = _mm512_fmadd_ps(sum, _mm512_mul_ps(ws, _mm512_set1_ps(a.xs[r0 + r])), b);
    pagedllm::store16(y + (r0 + r) * y_stride + tile * kTile, out);
  }
}

template <typename T, int R>
void tile_rows_for(int rows, const Args& a, int64_t tile, int64_t r0, T* y, int64_t y_stride) {
  if constexpr (R > 1)
    if (rows < R) return tile_rows_for<T, R - 1>(rows, a, tile, r0, y, y_stride);
  tile_rows<T, R>(a, tile, r0, y, y_stride);
}

template <typename T>
void run(const torch::Tensor& x, const Args& base, int64_t n, torch::Tensor& y) {
  const int64_t rows = x.size(0), k = base.k;
  std::vector<uint8_t> xq(rows * k);
  std::vector<float> xs(rows);
  const T* xp = x.data_ptr<T>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads()) if (rows >= 4)
  for (int64_t m = 0; m < rows; ++m) quantize_row<T>(xp + m * x.stride(0), k, xq.data() + m * k, xs.data() + m);
  Args a = base;
  a.xq = xq.data();
  a.xs = xs.data();
  T* yp = y.data_ptr<T>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t t = 0; t < n / kTile; ++t)
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
      tile_rows_for<T, kRowBlock>(static_cast<int>(std::min<int64_t>(kRowBlock, rows - r0)), a, t, r0, yp, n);
}

}  // namespace

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor wsum,
                          std::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kTile &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "packed must be contiguous int8 [N/16, K/4, 16, 4]");
  const int64_t n = packed.size(0) * kTile, k = packed.size(1) * 4;
  TORCH_CHECK(k % 16 == 0, "K must be a multiple of 16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n &&
                  wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.numel() == n,
              "scales (float32) and wsum (int32) must be contiguous [N]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bfloat16 or float32 [rows, K] with contiguous rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias must be contiguous float32 [N]");
  auto y = torch::empty({x.size(0), n}, x.options());
  const Args a{nullptr, nullptr, k, packed.data_ptr<int8_t>(), scales.data_ptr<float>(), wsum.data_ptr<int32_t>(),
               bias ? bias->data_ptr<float>() : nullptr};
  if (x.scalar_type() == at::kFloat)
    run<float>(x, a, n, y);
  else
    run<at::BFloat16>(x, a, n, y);
  return y;
}
