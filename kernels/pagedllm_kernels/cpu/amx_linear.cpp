// bf16 linear layers y = x W^T + b on CPUs with AMX. The weight is packed once (amx_linear.py) into the
// order the tile multiply reads it: for each pair of 16-column panels, K/32 steps of two 1 KB B tiles, all in
// one sequential run. A thread owns a contiguous range of panel pairs, so at decode batch sizes the layer
// streams its weight from memory exactly once while the tiles multiply every row with it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_tiles.h"
#include "ops.h"
#include "simd.h"

#include <cstdint>

namespace {

constexpr int64_t kRowBlock = 256;  // rows per pass over the weight
// On the first row pair of a pass the weight comes from memory: request it this many K steps (2 KB each)
// ahead into L2 (measured best of 4-64 steps, T0 or T1: 16 steps into L2 brought the decode-sized layers of
// the 125M model to 17-21 GB/s, from 14-15 with oneDNN's packed path).
constexpr int64_t kPrefetchSteps = 16;

// Tiles: C00, C01, C10, C11 (fp32 accumulators of rows 0-15 / 16-31 by panel 0 / 1), A0, A1, B0, B1.
void configure_tiles() {
  pagedllm::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;  // 16 fp32, or 16 pairs of bf16
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Rows [m, m + 32) of x times panel pair `pp` into y (rows >= rows_out are padding and not written).
void row_pair_times_panel_pair(const at::BFloat16* x, const at::BFloat16* panel, const float* bias,
                               at::BFloat16* y, int64_t m, int64_t pp, int64_t K, int64_t N, int64_t rows_out,
                               bool prefetch) {
  const int64_t steps = K / 32, x_stride = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* b = panel + s * 1024;  // two 16 x 32 tiles
    if (prefetch) {  // past the panel pair's end this runs into the next ones, which come next anyway
      const char* ahead = reinterpret_cast<const char*>(b + kPrefetchSteps * 1024);
      for (int off = 0; off < 2048; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
    }
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 512, 64);
    _tile_loadd(4, x + m * K + s * 32, x_stride);
    _tile_loadd(5, x + (m + 16) * K + s * 32, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[4][16][16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  const int64_t n0 = pp * 32;
  for (int half = 0; half < 2; ++half) {  // rows 0-15, 16-31
    for (int i = 0; i < 16; ++i) {
      const int64_t row = m + half * 16 + i;
      if (row >= rows_out) return;
      for (int p = 0; p < 2; ++p) {
        __m512 v = _mm512_load_ps(c[half * 2 + p][i]);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + p * 16));
        pagedllm::store16(y + row * N + n0 + p * 16, v);
      }
    }
  }
}

}  // namespace

// x [M, K] bf16; packed [N/32, K/32, 2, 16, 16, 2] bf16 (amx_linear.pack); bias [N] fp32 or none.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(pagedllm::amx_permitted(), "the kernel refused AMX to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "x must be [rows, in_features] bf16 and the packed weight bf16");
  TORCH_CHECK(packed.dim() == 6 && packed.is_contiguous() && packed.size(2) == 2 && packed.size(3) == 16 &&
                  packed.size(4) == 16 && packed.size(5) == 2,
              "the weight must be packed by amx_linear.pack");
  const int64_t M = x.size(0), K = packed.size(1) * 32, N = packed.size(0) * 32;
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "bias must be [out_features] fp32");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  // Tiles read whole row pairs: pad x to a multiple of 32 rows (decode batches usually need none).
  const int64_t padded = (M + 31) / 32 * 32;
  torch::Tensor xs = x.contiguous();
  if (padded != M) xs = torch::cat({xs, torch::zeros({padded - M, K}, x.options())});
  const at::BFloat16* xp = xs.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t pairs = N / 32, panel_elems = K * 32;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    configure_tiles();
    for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
      const int64_t r1 = std::min(r0 + kRowBlock, padded);
#pragma omp for schedule(static)
      for (int64_t pp = 0; pp < pairs; ++pp)
        for (int64_t m = r0; m < r1; m += 32)
          row_pair_times_panel_pair(xp, wp + pp * panel_elems, bp, yp, m, pp, K, N, M, m == r0);
    }
    _tile_release();
  }
  return y;
}
