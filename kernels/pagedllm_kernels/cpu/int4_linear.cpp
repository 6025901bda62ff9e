// Weight-only int4 linear for bf16 on the CPU: y = x W^T (+ b), W dequantized inside the matmul, never stored.
//
// The weight in the layout of int4_layout.py: per tile of 16 output columns, per pair of input rows (k, k + 1),
// 16 bytes (one per column: k's code in the low nibble, k + 1's in the high nibble); per (tile, group) the 16
// columns' scales s and mins m = s * zero, so W[n, k] = s * code - m.
//
// A byte's two nibbles become one 32-bit lane of two bf16 holding code + 128 exactly (0x4300 is 128.0 in bf16
// and its 7 mantissa bits take the code), so one AVX512-BF16 pair dot product multiplies 16 columns x 2 input
// rows by a pair of x. Per group g and row r, with D = sum over the group of x * (code + 128) and X the sum of
// x over the group:  y += s * D - (128 s + m) * X.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

constexpr int kTile = 16;
constexpr int kRowBlock = 8;  // rows of x per pass over a tile's weight: 2 accumulators each in registers

inline __m512i codes_as_bf16_pairs(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(0xF));
  const __m512i hi = _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16);
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi32(0x43004300), 0xFE);  // lo | hi | 128.0 pairs
}

struct Args {
  const at::BFloat16* x;
  int64_t x_stride, k, groups, group_size;
  const uint8_t* packed;
  const float *scales, *mins, *xsum, *bias;
  at::BFloat16* y;
  int64_t y_stride;
};

// Rows r0..r0+R-1 of y for one tile of 16 columns; the weight's pair vectors unpacked as they are read, or
// (`unpacked`, for more than one block of rows) read from the tile's buffer of them.
template <int R>
void tile_rows(const Args& a, int64_t tile, int64_t r0, const __m512i* unpacked) {
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const int64_t pairs = a.group_size / 2;
  const uint8_t* w = a.packed + tile * (a.k / 2) * kTile;
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const int32_t*>(a.x + (r0 + r) * a.x_stride);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 d[R];
    for (int r = 0; r < R; ++r) d[r] = _mm512_setzero_ps();
    for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
      const __m512 wv = _mm512_castsi512_ps(unpacked ? _mm512_load_si512(unpacked + p) : codes_as_bf16_pairs(w + p * kTile));
      for (int r = 0; r < R; ++r)
        d[r] = _mm512_dpbf16_ps(d[r], (__m512bh)wv, (__m512bh)_mm512_castsi512_ps(_mm512_set1_epi32(xr[r][p])));
    }
    const __m512 s = _mm512_loadu_ps(a.scales + (tile * a.groups + g) * kTile);
    const __m512 c = _mm512_fmadd_ps(s, _mm512_set1_ps(128.0f), _mm512_loadu_ps(a.mins + (tile * a.groups + g) * kTile));
    for (int r = 0; r < R; ++r) {
      y[r] = _mm512_fmadd_ps(s, d[r], y[r]);
      y[r] = _mm512_fnmadd_ps(c, _mm512_set1_ps(a.xsum[(r0 + r) * a.groups + g]), y[r]);
    }
  }
  const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + tile * kTile) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    pagedllm::store16(a.y + (r0 + r) * a.y_stride + tile * kTile, _mm512_add_ps(y[r], b));
}

template <int R>
void tile_rows_for(int rows, const Args& a, int64_t tile, int64_t r0, const __m512i* unpacked) {
  if constexpr (R > 1)
    if (rows < R) return tile_rows_for<R - 1>(rows, a, tile, r0, unpacked);
  tile_rows<R>(a, tile, r0, unpacked);
}

void check_weight(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& mins,
                  int64_t group_size) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kTile &&
                  packed.is_contiguous(),
              "packed must be contiguous uint8 [N/16, K/2, 16]");
  const int64_t k = packed.size(1) * 2;
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0,
              "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  mins.is_contiguous() && scales.sizes() == mins.sizes() && scales.dim() == 3 &&
                  scales.size(0) == packed.size(0) && scales.size(1) == k / group_size && scales.size(2) == kTile,
              "scales and mins must be contiguous float32 [N/16, K/group_size, 16]");
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                          int64_t group_size, std::optional<torch::Tensor> bias) {
  check_weight(packed, scales, mins, group_size);
  const int64_t n = packed.size(0) * kTile, k = packed.size(1) * 2, groups = k / group_size;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 &&
                  x.stride(0) % 2 == 0,
              "x must be bfloat16 [rows, K] with contiguous, 4-byte aligned rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias must be contiguous float32 [N]");
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, n}, x.options());
  // Each row's sum of x per group, for the zero points' and the 128 offset's share.
  auto xsum = x.view({rows, groups, group_size}).sum(-1, false, at::kFloat).contiguous();
  const Args a{x.data_ptr<at::BFloat16>(), x.stride(0), k, groups, group_size, packed.data_ptr<uint8_t>(),
               scales.data_ptr<float>(), mins.data_ptr<float>(), xsum.data_ptr<float>(),
               bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), n};
  const int64_t tiles = n / kTile;
  // More than one block of rows: each tile's pair vectors are unpacked once into a buffer (K/2 x 64 bytes, in
  // L1 or L2) that every block then reads, so the unpacking is not repeated per block.
  const bool buffered = rows > kRowBlock;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<__m512i> unpacked(buffered ? k / 2 : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      if (buffered)
        for (int64_t p = 0; p < k / 2; ++p) unpacked[p] = codes_as_bf16_pairs(a.packed + (t * (k / 2) + p) * kTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        tile_rows_for<kRowBlock>(static_cast<int>(std::min<int64_t>(kRowBlock, rows - r0)), a, t, r0,
                                 buffered ? unpacked.data() : nullptr);
    }
  }
  return y;
}

// The plain bf16 [N, K] weight, for batches large enough that oneDNN's matmul on it wins.
void int4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group_size,
                     torch::Tensor out) {
  check_weight(packed, scales, mins, group_size);
  const int64_t n = packed.size(0) * kTile, k = packed.size(1) * 2, groups = k / group_size;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(0) == n && out.size(1) == k,
              "out must be contiguous bfloat16 [N, K]");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  int32_t* o = reinterpret_cast<int32_t*>(out.data_ptr<at::BFloat16>());
  const int64_t pairs = group_size / 2, row_units = k / 2;
  // lane j's two values (k, k + 1) are one 32-bit unit of row n0 + j: scattered 16 at a time
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int32_t>(row_units)));
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t t = 0; t < n / kTile; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 s = _mm512_loadu_ps(sp + (t * groups + g) * kTile);
      const __m512 m = _mm512_loadu_ps(mp + (t * groups + g) * kTile);
      for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (t * row_units + p) * kTile)));
        const __m512 lo = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF))), s, m);
        const __m512 hi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, m);
        const __m512i lo16 = _mm512_cvtepu16_epi32(pagedllm::to_bf16(lo));
        const __m512i hi16 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(pagedllm::to_bf16(hi)), 16);
        _mm512_i32scatter_epi32(o + t * kTile * row_units + p, lanes, _mm512_or_si512(lo16, hi16), 4);
      }
    }
  }
}
