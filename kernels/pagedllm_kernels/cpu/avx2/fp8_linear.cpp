// fp8 (e4m3) weight linears for CPUs with AVX2, F16C and FMA but no AVX-512, on the weight as fp8_layout.py
// arranges it for every CPU kernel: [N/16, K/2, 16, 2], column j's elements for inputs k and k + 1 side by side,
// one fp32 scale per column. The CPU has no fp8 arithmetic: 16 bytes (8 columns x 2 inputs) widen through F16C
// to two vectors [c0(k) c0(k+1) c1(k) c1(k+1) ...], and each row's x pair (k, k+1), broadcast as one 64-bit
// value, multiplies them as they lie; the two lanes of each column's sum are added once at the end.
// Before this kernel an AVX2 host dequantized the whole weight in torch on every call. Beyond a few rows the
// widening costs more than the bytes save: `avx2_fp8_dequantize_tiles` writes the weight once per call as the
// bf16 linear's tiles (bf16_linear.cpp), for that kernel to run.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

namespace {

using pagedllm_avx2::e4m3_as_halves16;
using pagedllm_avx2::kE4m3Unscale;
using pagedllm_avx2::round_to_e4m3;
using pagedllm_avx2::to_bf16_8;

constexpr int kTile = 16;  // output columns per tile (32 bytes per pair of inputs)
constexpr int kRows = 3;   // rows of x per block: 12 sums, 2 weight vectors at a time

struct Args {
  const float* x;  // [rows, k] fp32
  const uint8_t* packed;  // [N/16, K/2, 16, 2] e4m3 bytes
  const float* scales;  // [N]
  const float* bias;  // [n] or null
  at::BFloat16* y;  // [rows, n]
  int64_t rows, k, n;
};

inline __m256 x_pair(const float* x) {  // (x[0], x[1]) repeated 4 times
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x)));
}

inline void widen(const uint8_t* p, __m256& wa, __m256& wb) {  // 16 bytes: 8 columns x 2 inputs
  const __m256i halves = e4m3_as_halves16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  wa = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));       // c0(k) c0(k+1) .. c3(k+1)
  wb = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));  // c4(k) .. c7(k+1)
}

// acc[r * 4 + q]: row r, columns 4q..4q+3 of the tile, each column's two lanes (inputs k, k + 1). Written out
// at compile time (fold expressions), as in bf16_linear.cpp, so that GCC keeps the sums in registers.
template <size_t... R>
inline void half_fma(__m256* acc, int q, __m256 wa, __m256 wb, const float* x, int64_t k,
                     std::index_sequence<R...>) {
  auto one = [&](size_t r) __attribute__((always_inline)) {
    const __m256 xp = x_pair(x + r * k);
    acc[r * 4 + q] = _mm256_fmadd_ps(wa, xp, acc[r * 4 + q]);
    acc[r * 4 + q + 1] = _mm256_fmadd_ps(wb, xp, acc[r * 4 + q + 1]);
  };
  (one(R), ...);
}

template <size_t... J>
inline void store_rows(const __m256* acc, const float* scale, const float* bias, at::BFloat16* y, int64_t n,
                       std::index_sequence<J...>) {
  auto one = [&](size_t j) __attribute__((always_inline)) {  // j = r * 2 + h: row r, columns 8h..8h+7
    const size_t r = j / 2, h = j % 2;
    // hadd gives columns (0 1 4 5 2 3 6 7) of the half; the 64-bit permute puts them in order.
    const __m256 pairs = _mm256_hadd_ps(acc[r * 4 + 2 * h], acc[r * 4 + 2 * h + 1]);
    __m256 sum = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(pairs), 0xD8));
    sum = _mm256_mul_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(scale + h * 8), _mm256_set1_ps(kE4m3Unscale)));
    if (bias) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + h * 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * n + h * 8), to_bf16_8(sum));
  };
  (one(J), ...);
}

// Rows r0..r0+R-1 of y for tile t. (Half-tile items with 6 rows per widening measured 0.77x this at 1 row and
// 0.9x at 2, faster only from 4 rows, where the bf16-tiles path soon takes over: perf/avx2_kernels.py.)
template <int R>
void block(const Args& a, int64_t r0, int64_t t) {
  __m256 acc[R * 4];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const uint8_t* p = a.packed + t * (a.k / 2) * kTile * 2;
  const float* x = a.x + r0 * a.k;
  for (int64_t k0 = 0; k0 < a.k; k0 += 2, p += kTile * 2) {
    for (int q = 0; q < 4; q += 2) {  // columns 0-7, then 8-15
      __m256 wa, wb;
      widen(p + q * 8, wa, wb);
      half_fma(acc, q, wa, wb, x + k0, a.k, std::make_index_sequence<R>{});
    }
  }
  store_rows(acc, a.scales + t * kTile, a.bias ? a.bias + t * kTile : nullptr, a.y + r0 * a.n + t * kTile, a.n,
             std::make_index_sequence<R * 2>{});
}

void rows_of(const Args& a, int64_t t) {
  int64_t r = 0;
  for (; r + kRows <= a.rows; r += kRows) block<kRows>(a, r, t);
  switch (a.rows - r) {
    case 2: return block<2>(a, r, t);
    case 1: return block<1>(a, r, t);
    default: return;
  }
}

void check_layout(const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(packed.element_size() == 1 && packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 &&
              packed.is_contiguous(), "packed must be contiguous e4m3 [N/16, K/2, 16, 2]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == packed.size(0) * kTile,
              "scales must be contiguous float32 with one per output column");
}

}  // namespace

torch::Tensor avx2_fp8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              std::optional<torch::Tensor> bias) {
  check_layout(packed, scales);
  const int64_t n = packed.size(0) * kTile, k = packed.size(1) * 2;
  const torch::Tensor xf = pagedllm_avx2::checked_fp32_rows(x, k, bias, n);
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
  const Args a{xf.data_ptr<float>(), static_cast<const uint8_t*>(packed.data_ptr()), scales.data_ptr<float>(),
               bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), x.size(0), k, n};
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rows_of(a, t);
  });
  return y;
}

void avx2_fp8_dequantize_tiles(torch::Tensor packed, torch::Tensor scales, torch::Tensor out) {
  check_layout(packed, scales);
  const int64_t tiles = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 3 &&
              out.size(0) == tiles * 2 && out.size(1) == k && out.size(2) == 8,
              "out must be contiguous bf16 [N/8, K, 8] (the bf16 linear's tiles)");
  const uint8_t* pp = static_cast<const uint8_t*>(packed.data_ptr());
  const float* sp = scales.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, tiles * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t half = begin; half < end; ++half) {  // columns 8h..8h+7 of tile t: the output's tile `half`
      const int64_t t = half / 2, h = half % 2;
      const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(sp + half * 8), _mm256_set1_ps(kE4m3Unscale));
      const uint8_t* p = pp + t * (k / 2) * kTile * 2 + h * 16;
      at::BFloat16* o = op + half * k * 8;
      for (int64_t k0 = 0; k0 < k; k0 += 2, p += kTile * 2, o += 16) {
        __m256 a, b;
        widen(p, a, b);
        // even lanes are input k, odd ones k + 1; shuffle gives columns (0 1 4 5 2 3 6 7), the permute orders them
        auto ordered = [](__m256 v) {
          return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
        };
        const __m256 w0 = ordered(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
        const __m256 w1 = ordered(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16_8(_mm256_mul_ps(w0, scale)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8), to_bf16_8(_mm256_mul_ps(w1, scale)));
      }
    }
  });
}

namespace {

float row_amax(const at::BFloat16* x, int64_t k) {
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8)
    m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), pagedllm_avx2::load8(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

}  // namespace

torch::Tensor avx2_fp8_round_input(torch::Tensor x, double static_scale, bool per_token) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 8 == 0,
              "x must be bfloat16 [rows, K] with contiguous rows, K a multiple of 8");
  const int64_t rows = x.size(0), k = x.size(1), stride = x.stride(0);
  torch::Tensor out = torch::empty({rows, k}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  std::vector<float> scales(rows, static_cast<float>(static_scale));
  if (static_scale <= 0) {
    for (int64_t m = 0; m < rows; ++m) scales[m] = std::max(row_amax(xp + m * stride, k) / 448.0f, 1e-12f);
    if (!per_token && rows > 0)
      std::fill(scales.begin(), scales.end(), *std::max_element(scales.begin(), scales.end()));
  }
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const __m256 sc = _mm256_set1_ps(scales[m]);  // x / scale divided, as torch does (not times 1 / scale)
      for (int64_t i = 0; i < k; i += 8) {
        const __m256 q = round_to_e4m3(_mm256_div_ps(pagedllm_avx2::load8(xp + m * stride + i), sc));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(op + m * k + i),
                         pagedllm_avx2::to_bf16_8(_mm256_mul_ps(q, sc)));
      }
    }
  });
  return out;
}
