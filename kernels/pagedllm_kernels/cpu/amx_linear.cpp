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

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRowBlock = 256;  // rows per pass over the weight
// A thread's first pass requests its weight this many K steps (2 KB each) ahead into L2 (measured best of
// 4-64 steps, T0 or T1: 16 steps into L2 brought the decode-sized layers of the 125M model to 17-21 GB/s, from
// 14-15 with oneDNN's packed path); its later passes request the next panel pair (below).
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
// Each step s also requests lines [s * lines_per_step, (s + 1) * lines_per_step) of `ahead` (those below
// ahead_lines) into L2: the weight the next passes read, so memory streams while the tiles multiply.
void row_pair_times_panel_pair(const at::BFloat16* x, const at::BFloat16* panel, const float* bias,
                               at::BFloat16* y, int64_t m, int64_t pp, int64_t K, int64_t N, int64_t rows_out,
                               const char* ahead, int64_t ahead_lines, int64_t lines_per_step) {
  const int64_t steps = K / 32, x_stride = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* b = panel + s * 1024;  // two 16 x 32 tiles
    for (int64_t l = s * lines_per_step; l < std::min((s + 1) * lines_per_step, ahead_lines); ++l)
      _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
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
  const int64_t steps = K / 32, panel_lines = steps * 32;  // a panel pair: 2 KB (32 lines) a step
#pragma omp parallel num_threads(at::get_num_threads())
  {
    configure_tiles();
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = pairs * t / threads, hi = pairs * (t + 1) / threads;  // this thread's panel pairs
    const char* w = reinterpret_cast<const char*>(wp);
    const int64_t panel_bytes = panel_elems * static_cast<int64_t>(sizeof(at::BFloat16));
    for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
      const int64_t r1 = std::min(r0 + kRowBlock, padded), passes = (r1 - r0) / 32;
      for (int64_t pp = lo; pp < hi; ++pp)
        for (int64_t m = r0; m < r1; m += 32) {
          const int64_t pass = (m - r0) / 32;
          // Each pass requests a 1/passes share of the thread's next panel pair, so the weight streams from
          // memory through every pass over this one, not through the first alone (which left the tile unit
          // waiting on memory there and memory idle after). The thread's first pass has nothing requested
          // for it: it requests the rest of its own panel pair from kPrefetchSteps steps ahead, and the next
          // one whole. The 125M model's decode-step linears streamed from memory on the Intel AMX host ran
          // 1.02-1.03x as fast this way as with the first pass alone prefetching at 1-32 rows, 1.08x at 64, 1.12x
          // at 128, 1.10x at 256 (perf/README.md, session 31).
          const bool cold = pp == lo && pass == 0;
          const int64_t skip = std::min(kPrefetchSteps, steps) * 32;  // lines the cold pass leaves to demand
          const char* ahead = cold ? w + pp * panel_bytes + skip * 64
                                   : w + (pp + 1) * panel_bytes + pass * (panel_lines / passes) * 64;
          const int64_t ahead_lines = cold ? (pp + 1 < hi ? 2 : 1) * panel_lines - skip
                                           : pp + 1 < hi ? panel_lines / passes : 0;
          const int64_t per_step = (ahead_lines + steps - 1) / steps;
          row_pair_times_panel_pair(xp, wp + pp * panel_elems, bp, yp, m, pp, K, N, M, ahead, ahead_lines,
                                    per_step);
        }
    }
    _tile_release();
  }
  return y;
}
