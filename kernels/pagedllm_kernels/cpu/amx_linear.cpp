// bf16 linear layers y = x W^T + b on CPUs with AMX. The weight is packed once (amx_linear.py) into the
// order the tile multiply reads it: for each pair of 16-column panels, K/32 steps of two 1 KB B tiles, all in
// one sequential run. A thread owns a contiguous range of panel pairs, so at decode batch sizes the layer
// streams its weight from memory exactly once while the tiles multiply every row with it.
//
// Rows go in blocks of 32 (two A tiles against the two B tiles, four fp32 accumulator tiles), at most 8 blocks
// to a pass over the weight. A pass of up to 5 blocks takes each panel pair whole, block by block, the later
// blocks reading it from L2 while each requests its share of the next one. A pass of 6 or more (prefill-sized
// batches) takes a panel pair a chunk of K steps at a time: the chunk comes from memory for the first block and
// from L1 for the others, each block's accumulators waiting in an L1 buffer between chunks, and every line of the
// next chunk is requested while they compute.
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

// The first pass over a thread's panel pairs requests its weight this many K steps (2 KB each) ahead into L2
// (measured best of 4-64 steps, T0 or T1: 16 steps into L2 brought the decode-sized layers of the 125M model to
// 17-21 GB/s, from 14-15 with oneDNN's packed path); its later passes request the next panel pair (below).
constexpr int64_t kPrefetchSteps = 16;
// Passes of this many row blocks or more go in chunks of kChunkSteps K steps (16 KB of weight). Against taking the
// panel pairs whole, on the 125M / 0.5B models' linears streamed from memory (perf/bf16_linear.py --kernel amx
// --against, 2026-12-06, three runs; an A/A run of one source read 0.96-0.99, the script's second build ahead):
// 256 rows 1.05-1.09 / 1.02-1.05x, 512 rows 1.03-1.17 / 1.04-1.06x; 192 rows (6 blocks) 0.97 / 1.04x. At 64 and
// 128 rows chunks were no faster (0.92-1.02x), whether they requested every line ahead or only started the L2
// streamer on each page (a tile load that misses stalls the tile unit, and at 2-4 blocks the lines requested
// ahead crowd the core's few line-fill buffers: it keeps only ~11 GB/s in flight by its own requests).
constexpr int64_t kChunkedBlocks = 6, kChunkSteps = 8;

// Tiles: C00, C01, C10, C11 (fp32 accumulators of rows 0-15 / 16-31 by panel 0 / 1), A0, A1, B0, B1.
void configure_tiles() {
  pagedllm::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;  // 16 fp32, or 16 pairs of bf16
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

using Accumulators = float[4][16][16];

// Rows [m, m + 32) of the 32 columns from n0 into y, bias added (rows >= rows_out are padding, not written).
void store_rows(const Accumulators& c, const float* bias, at::BFloat16* y, int64_t m, int64_t n0, int64_t N,
                int64_t rows_out) {
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

struct Linear {
  const at::BFloat16* x;  // [padded rows, K]
  const at::BFloat16* w;  // packed
  const float* bias;
  at::BFloat16* y;
  int64_t rows, K, N;
};

// The accumulator tiles C00-C11: cleared, loaded from or stored to c.
__attribute__((always_inline)) inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
__attribute__((always_inline)) inline void load_accumulators(const Accumulators& c) {
  _tile_loadd(0, c[0], 64);
  _tile_loadd(1, c[1], 64);
  _tile_loadd(2, c[2], 64);
  _tile_loadd(3, c[3], 64);
}
__attribute__((always_inline)) inline void store_accumulators(Accumulators& c) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}

// One K step: rows [m, m + 32) of x (steps of 32 columns) times the step's two B tiles at b, into C00-C11.
__attribute__((always_inline)) inline void tile_step(const at::BFloat16* b, const at::BFloat16* x, int64_t m,
                                                     int64_t K, int64_t s) {
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + 512, 64);
  _tile_loadd(4, x + m * K + s * 32, K * 2);
  _tile_loadd(5, x + (m + 16) * K + s * 32, K * 2);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// Rows [m, m + 32) of x times panel pair `pp` into y (rows >= rows_out are padding and not written).
// Each step s also requests lines [s * lines_per_step, (s + 1) * lines_per_step) of `ahead` (those below
// ahead_lines) into L2: the weight the next passes read, so memory streams while the tiles multiply.
void row_pair_times_panel_pair(const Linear& a, const at::BFloat16* panel, int64_t m, int64_t pp,
                               const char* ahead, int64_t ahead_lines, int64_t lines_per_step) {
  const at::BFloat16* x = a.x;  // locals, kept in registers across the tile instructions' asm
  const int64_t K = a.K, steps = K / 32;
  zero_accumulators();
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* b = panel + s * 1024;  // two 16 x 32 tiles
    for (int64_t l = s * lines_per_step; l < std::min((s + 1) * lines_per_step, ahead_lines); ++l)
      _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
    tile_step(b, x, m, K, s);
  }
  alignas(64) Accumulators c;
  store_accumulators(c);
  store_rows(c, a.bias, a.y, m, pp * 32, a.N, a.rows);
}

// This thread's panel pairs [lo, hi), each whole, times the `blocks` row blocks from row r0.
void pass_over_whole_panels(const Linear& a, int64_t r0, int64_t blocks, int64_t lo, int64_t hi) {
  const int64_t steps = a.K / 32, panel_elems = a.K * 32, panel_lines = steps * 32;  // 2 KB (32 lines) a step
  const char* w = reinterpret_cast<const char*>(a.w);
  const int64_t panel_bytes = panel_elems * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t pp = lo; pp < hi; ++pp)
    for (int64_t pass = 0; pass < blocks; ++pass) {
      // Each pass requests a 1/blocks share of the thread's next panel pair, so the weight streams from memory
      // through every pass over this one, not through the first alone (which left the tile unit waiting on
      // memory there and memory idle after). The thread's first pass has nothing requested for it: it requests
      // the rest of its own panel pair from kPrefetchSteps steps ahead, and the next one whole. The 125M model's
      // decode-step linears streamed from memory on the Intel AMX host ran 1.02-1.03x as fast this way as with
      // the first pass alone prefetching at 1-32 rows, 1.08x at 64, 1.12x at 128 (perf/README.md, session 31).
      const bool cold = pp == lo && pass == 0;
      const int64_t skip = std::min(kPrefetchSteps, steps) * 32;  // lines the cold pass leaves to demand
      const char* ahead = cold ? w + pp * panel_bytes + skip * 64
                               : w + (pp + 1) * panel_bytes + pass * (panel_lines / blocks) * 64;
      const int64_t ahead_lines = cold ? (pp + 1 < hi ? 2 : 1) * panel_lines - skip
                                       : pp + 1 < hi ? panel_lines / blocks : 0;
      const int64_t per_step = (ahead_lines + steps - 1) / steps;
      row_pair_times_panel_pair(a, a.w + pp * panel_elems, r0 + pass * 32, pp, ahead, ahead_lines, per_step);
    }
}

// This thread's panel pairs [lo, hi), a chunk of K steps at a time, times the `blocks` row blocks from row r0;
// acc holds one Accumulators per block. While the blocks compute on a chunk, every line of the next one (the
// next panel pair's first, after a panel pair's last) is requested into the last-level cache (T2), a few with
// each tile step.
void pass_over_panel_chunks(const Linear& a, int64_t r0, int64_t blocks, int64_t lo, int64_t hi,
                            Accumulators* acc) {
  const at::BFloat16* x = a.x;  // locals, kept in registers across the tile instructions' asm
  const int64_t K = a.K, steps = K / 32, panel_elems = K * 32;
  const char* end = reinterpret_cast<const char*>(a.w + hi * panel_elems);  // this thread's weight ends here
  for (int64_t pp = lo; pp < hi; ++pp) {
    const at::BFloat16* panel = a.w + pp * panel_elems;
    for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
      const int64_t s1 = std::min(s0 + kChunkSteps, steps), chunk_steps = s1 - s0;
      const char* next = reinterpret_cast<const char*>(panel + s1 * 1024);  // the chunk after this one
      const int64_t ahead_lines = std::min(std::max<int64_t>(end - next, 0) / 64, chunk_steps * 32);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m = r0 + b * 32;
        if (s0 == 0)
          zero_accumulators();
        else
          load_accumulators(acc[b]);
        const int64_t share_lo = ahead_lines * b / blocks, share_hi = ahead_lines * (b + 1) / blocks;
        const int64_t per_step = (share_hi - share_lo + chunk_steps - 1) / chunk_steps;
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t l0 = share_lo + (s - s0) * per_step, l1 = std::min(l0 + per_step, share_hi);
          for (int64_t l = l0; l < l1; ++l) _mm_prefetch(next + l * 64, _MM_HINT_T2);
          const at::BFloat16* bt = panel + s * 1024;  // two 16 x 32 tiles
          tile_step(bt, x, m, K, s);
        }
        store_accumulators(acc[b]);
        if (s1 == steps) store_rows(acc[b], a.bias, a.y, m, pp * 32, a.N, a.rows);
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
  const Linear a{xs.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
                 bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), M, K, N};
  const int64_t pairs = N / 32;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    configure_tiles();
    alignas(64) Accumulators acc[kRowBlock / 32];
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = pairs * t / threads, hi = pairs * (t + 1) / threads;  // this thread's panel pairs
    for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
      const int64_t blocks = (std::min(r0 + kRowBlock, padded) - r0) / 32;
      if (blocks >= kChunkedBlocks)
        pass_over_panel_chunks(a, r0, blocks, lo, hi, acc);
      else
        pass_over_whole_panels(a, r0, blocks, lo, hi);
    }
    _tile_release();
  }
  return y;
}
