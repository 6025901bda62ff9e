// Quantized-weight linears for bf16 on the CPU: y = x W^T (+ b), W dequantized inside the matmul, never stored.
// Every format gives, per tile of 16 output columns and pair of input rows (k, k + 1), one vector of 16 bf16
// pairs, which one AVX512-BF16 pair dot product multiplies by a pair of x.
//
// int4 (int4_layout.py): 16 bytes per pair (one per column: k's code in the low nibble, k + 1's in the high);
// per (tile, group) the columns' scales s and mins m = s * zero, so W[n, k] = s * code - m. A byte's nibbles
// become two bf16 holding code + 128 exactly (0x4300 is 128.0 and its 7 mantissa bits take the code). Per group
// g and row r, with D = sum over the group of x * (code + 128) and X the sum of x over the group:
//   y += s * D - (128 s + m) * X.
// fp8 (fp8_linear.py): 32 bytes per pair (column j's two e4m3 elements side by side), widened exactly by
// simd.h's table lookups; one group over all of K with each column's scale: y = s * D.
// bf16 (bf16_tiles.py): a dense weight in fp8's arrangement, 64 bytes per pair read as they are; no scale. For
// decode-sized batches and short prompts (up to 256 rows), where it ran 1.04-1.9x as fast as oneDNN's packed matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

constexpr int kTile = 16;
constexpr int kRowBlock = 8;  // rows of x per pass over a tile's weight (see tiles for the tiles per pass)

inline __m512i codes_as_bf16_pairs(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(0xF));
  const __m512i hi = _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16);
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi32(0x43004300), 0xFE);  // lo | hi | 128.0 pairs
}

inline __m512i fp8_pairs(const uint8_t* p) {
  return _mm512_castps_si512(pagedllm::fp8x32_to_bf16(reinterpret_cast<const c10::Float8_e4m3fn*>(p)));
}

struct Args {
  const at::BFloat16* x;
  int64_t x_stride, k, groups, group_size;
  const uint8_t* packed;
  const float *scales, *mins, *xsum, *bias;  // int4: mins and xsum; fp8: neither (nullptr)
  at::BFloat16* y;
  int64_t y_stride;
};

// A format: its bytes per pair vector, how they become one, whether it is packed (unpacked as it is read, its
// groups carrying scales), from how many rows its weight stream is prefetched in software, and up to how many rows
// a whole batch takes one tile per pass.
struct Bf16 {
  static constexpr int64_t kPairBytes = 64;
  static constexpr bool kPacked = false;
  static constexpr int kPrefetchFrom = 5, kOneTileRows = 0;
  static __m512i pairs(const uint8_t* p) { return _mm512_loadu_si512(p); }
};
struct Int4 {
  static constexpr int64_t kPairBytes = 16;
  static constexpr bool kPacked = true;
  static constexpr int kPrefetchFrom = 1, kOneTileRows = 8;
  static __m512i pairs(const uint8_t* p) { return codes_as_bf16_pairs(p); }
};
struct Fp8 {
  static constexpr int64_t kPairBytes = 32;
  static constexpr bool kPacked = true;
  static constexpr int kPrefetchFrom = 1, kOneTileRows = 8;
  static __m512i pairs(const uint8_t* p) { return fp8_pairs(p); }
};

// How far ahead of its reads each tile's weight stream is requested. Where a pass is busy enough per weight byte
// (bf16 from 5 rows: each vector feeds 15-24 dot products; int4 and fp8 in batches of up to 8 rows: each is
// unpacked first; above, the buffer's fill reads the packed weight once, unprefetched), the hardware prefetcher
// alone no longer keeps the streams ahead on Zen 5. Measured there, alternated: bf16 8 rows
// 1.08-1.33x, 16 rows 1.23-1.40x, 32-64 rows 1.10-1.2x; int4 at 1-4 rows 1.1-1.25x (in the one-tile pass below).
// 1.5-12 KiB ahead were within noise of each other. Bf16 at 1-4 rows streams at the host's bandwidth without it
// (and loses 5-10% with). On Zen 4 software prefetch had only slowed an earlier bf16 version, so bf16's is the
// caller's choice (`prefetch`, raced at load: linear_race.py); int4 and fp8 always prefetch there (measured on
// Zen 5 only). A request past a stream's end reads nothing.
constexpr int64_t kPrefetchBytes = 3072;

// Rows r0..r0+R-1 of y for tiles tile..tile+T-1: one pass over K, each broadcast pair of x feeding T pair dot
// products, each summed in U independent chains (pair p in chain p mod U, a group's last p mod U pairs in chain
// 0) so the dot product's latency is hidden when R x T alone is too few. The pair vectors are F's, unpacked as
// they are read, or (kBuffered) already unpacked in `buf`, tile t's at buf + t * K/2. Packed formats sum each
// group's dot products apart and fold them into y with the group's scales.
template <class F, int R, int T, int U, bool kPrefetch, bool kBuffered>
void tiles_rows(const Args& a, int64_t tile, int64_t r0, const __m512i* buf) {
  constexpr int64_t kBytes = kBuffered ? 64 : F::kPairBytes;
  const int64_t pairs = a.k / 2, group_pairs = a.group_size / 2;
  const uint8_t* w = kBuffered ? reinterpret_cast<const uint8_t*>(buf) : a.packed + tile * pairs * kBytes;
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const int32_t*>(a.x + (r0 + r) * a.x_stride);
  __m512 y[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) y[t][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 du[U][T][R];  // the chains, summed at the group's end
    for (int u = 0; u < U; ++u)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) du[u][t][r] = _mm512_setzero_ps();
    // One pair: T weight vectors, each broadcast pair of x into T of chain d's accumulators.
    const auto pair = [&](int64_t p, __m512 (&d)[T][R]) __attribute__((always_inline)) {
      if constexpr (kPrefetch && !kBuffered && R >= F::kPrefetchFrom)
        for (int t = 0; t < T; ++t)
          _mm_prefetch(reinterpret_cast<const char*>(w + (t * pairs + p) * kBytes + kPrefetchBytes), _MM_HINT_T0);
      __m512 wv[T];
      for (int t = 0; t < T; ++t)
        wv[t] = _mm512_castsi512_ps(kBuffered ? _mm512_load_si512(w + (t * pairs + p) * kBytes)
                                              : F::pairs(w + (t * pairs + p) * kBytes));
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_castsi512_ps(_mm512_set1_epi32(xr[r][p]));
        for (int t = 0; t < T; ++t) d[t][r] = _mm512_dpbf16_ps(d[t][r], (__m512bh)wv[t], xb);
      }
    };
    int64_t p = g * group_pairs;
    const int64_t end = p + group_pairs;
    for (; p + U <= end; p += U)
      for (int u = 0; u < U; ++u) pair(p + u, du[u]);
    for (; p < end; ++p) pair(p, du[0]);  // a group of fewer pairs than chains, or its rest (fp8 of any even K)
    __m512 d[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        d[t][r] = du[0][t][r];
        for (int u = 1; u < U; ++u) d[t][r] = _mm512_add_ps(d[t][r], du[u][t][r]);
      }
    if constexpr (!F::kPacked) {  // one group, no scale
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) y[t][r] = d[t][r];
      continue;
    }
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((tile + t) * a.groups + g) * kTile;
      const __m512 s = _mm512_loadu_ps(a.scales + at);
      for (int r = 0; r < R; ++r) y[t][r] = _mm512_fmadd_ps(s, d[t][r], y[t][r]);
      if (a.mins) {  // int4: y -= (128 s + m) * X, X the group's sum of x (see the top of the file)
        const __m512 c = _mm512_fmadd_ps(s, _mm512_set1_ps(128.0f), _mm512_loadu_ps(a.mins + at));
        for (int r = 0; r < R; ++r)
          y[t][r] = _mm512_fnmadd_ps(c, _mm512_set1_ps(a.xsum[(r0 + r) * a.groups + g]), y[t][r]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + (tile + t) * kTile) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      pagedllm::store16(a.y + (r0 + r) * a.y_stride + (tile + t) * kTile, _mm512_add_ps(y[t][r], b));
  }
}

// Tiles per pass over the weight for `rows` rows, `wide` when they are the whole batch (why: see tiles below).
template <class F>
constexpr int pass_tiles(int rows, bool wide) {
  return wide && rows <= F::kOneTileRows ? 1 : rows <= 4 ? 4 : (wide ? 3 : 2);
}

// Tiles [tile, tile + count) for rows r0..r0+R-1, T at a time, the last (count % T) one at a time.
// bf16: 4 tiles for up to 4 rows; for 5-8, 3 tiles when the rows are the whole batch (`kWide`: 24 accumulators, 8
// rows 11% faster than 2 tiles on Zen 5, in one process) and 2 when they are one block of many (3 was 4-10% slower
// at 64-128 rows). One tile per pass had made 8 rows issue 8 broadcasts per weight vector and run 1.6x as long as
// two (125M shapes, Zen 4).
// int4 and fp8: a whole batch of up to 8 rows takes one tile per pass in 4 chains (2 from 5 rows), so each thread
// reads one contiguous stream, as the packed tiles lie, while their unpacking, not the broadcasts, bounds the pass;
// 3-4 tiles per pass (bf16's choice) were 10-20% slower at 1-8 rows. Blocks of many rows read the unpacked buffer
// as bf16 reads its weight (2 tiles per pass, 4 for a last block of up to 4 rows; one tile was 8-12% slower at
// 16-64 rows). Against the one-tile, one-chain pass without prefetch and with a buffer per tile before
// (perf/quantized_linear.py --stream --model 0.5b --against, Zen 5, alternated): int4 1 / 2 / 4 / 8 / 16 / 64 rows
// 1.24 / 1.27 / 1.43 / 1.40 / 1.26 / 1.36x, fp8 1.03 / 1.08 / 1.11 / 1.62 / 1.24 / 1.37x.
template <class F, int R, bool kWide, bool kPrefetch, bool kBuffered>
void tiles(const Args& a, int64_t tile, int64_t count, int64_t r0, const __m512i* buf) {
  constexpr bool kOneTile = kWide && R <= F::kOneTileRows;
  constexpr int T = pass_tiles<F>(R, kWide), U = kOneTile ? (R <= 4 ? 4 : 2) : 1;
  const int64_t pairs = a.k / 2;
  int64_t t = 0;
  const auto at = [&](int64_t i) { return kBuffered ? buf + i * pairs : nullptr; };  // tile i's unpacked vectors
  for (; t + T <= count; t += T) tiles_rows<F, R, T, U, kPrefetch, kBuffered>(a, tile + t, r0, at(t));
  for (; t < count; ++t) tiles_rows<F, R, 1, U, kPrefetch, kBuffered>(a, tile + t, r0, at(t));
}

template <class F, int R, bool kWide, bool kPrefetch, bool kBuffered>
void tiles_for(int rows, const Args& a, int64_t tile, int64_t count, int64_t r0, const __m512i* buf) {
  if constexpr (R > 1)
    if (rows < R) return tiles_for<F, R - 1, kWide, kPrefetch, kBuffered>(rows, a, tile, count, r0, buf);
  tiles<F, R, kWide, kPrefetch, kBuffered>(a, tile, count, r0, buf);
}

// A batch of up to 8 rows (`kWide`, one block): each thread one contiguous run of tiles, the runs as even as whole
// passes allow (12-tile runs before had left 0.5B's o and down projections, 56 tiles, split 36 / 20 between two
// threads: ~9% of a decode step's linear time). More rows: groups of 4 tiles, handed out in static runs, every
// block of 8 rows passing over a group's weight while it is still in L2 or nearby; int4 and fp8 unpack each group
// once into the thread's buffer (4 x K/2 x 64 bytes: 608 KiB at K = 4,864) that every block then reads, so the
// unpacking is not repeated per block.
template <class F, bool kWide, bool kPrefetch>
void groups(const Args& a, int64_t rows, int64_t tiles_n) {
  const int64_t threads = at::get_num_threads();
  if constexpr (kWide) {
    const int64_t step = pass_tiles<F>(static_cast<int>(rows), true), passes = (tiles_n + step - 1) / step;
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int64_t i = 0; i < threads; ++i) {
      const int64_t t0 = std::min(tiles_n, passes * i / threads * step);
      const int64_t t1 = std::min(tiles_n, passes * (i + 1) / threads * step);
      if (t1 > t0)
        tiles_for<F, kRowBlock, true, kPrefetch, false>(static_cast<int>(rows), a, t0, t1 - t0, 0, nullptr);
    }
    return;
  }
  constexpr bool kBuffered = F::kPacked;
  constexpr int64_t kGroup = 4;
  const int64_t pairs = a.k / 2, groups_n = (tiles_n + kGroup - 1) / kGroup;
#pragma omp parallel num_threads(threads)
  {
    // uninitialised (the fill writes what a block reads); new[] of an over-aligned type aligns it (C++17)
    const std::unique_ptr<__m512i[]> unpacked(kBuffered ? new __m512i[kGroup * pairs] : nullptr);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups_n; ++g) {
      const int64_t count = std::min(kGroup, tiles_n - g * kGroup);
      if constexpr (kBuffered)
        for (int64_t p = 0; p < count * pairs; ++p)
          unpacked[p] = F::pairs(a.packed + (g * kGroup * pairs + p) * F::kPairBytes);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        tiles_for<F, kRowBlock, false, kPrefetch, kBuffered>(static_cast<int>(std::min<int64_t>(kRowBlock, rows - r0)),
                                                             a, g * kGroup, count, r0, unpacked.get());
    }
  }
}

// `prefetch`: bf16's choice; int4 and fp8 always prefetch (see kPrefetchBytes).
template <class F>
void all_tiles(const Args& a, int64_t rows, int64_t tiles_n, bool prefetch = true) {
  if constexpr (F::kPacked)
    rows <= kRowBlock ? groups<F, true, true>(a, rows, tiles_n) : groups<F, false, true>(a, rows, tiles_n);
  else if (rows <= kRowBlock)
    prefetch ? groups<F, true, true>(a, rows, tiles_n) : groups<F, true, false>(a, rows, tiles_n);
  else
    prefetch ? groups<F, false, true>(a, rows, tiles_n) : groups<F, false, false>(a, rows, tiles_n);
}

void check_x(const torch::Tensor& x, int64_t k, int64_t n, const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 &&
                  x.stride(0) % 2 == 0,
              "x must be bfloat16 [rows, K] with contiguous, 4-byte aligned rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias must be contiguous float32 [N]");
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
  check_x(x, k, n, bias);
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, n}, x.options());
  // Each row's sum of x per group, for the zero points' and the 128 offset's share.
  auto xsum = x.view({rows, groups, group_size}).sum(-1, false, at::kFloat).contiguous();
  const Args a{x.data_ptr<at::BFloat16>(), x.stride(0), k, groups, group_size, packed.data_ptr<uint8_t>(),
               scales.data_ptr<float>(), mins.data_ptr<float>(), xsum.data_ptr<float>(),
               bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), n};
  all_tiles<Int4>(a, rows, n / kTile);
  return y;
}

// fp8: packed [N/16, K/2, 16, 2] float8_e4m3fn (fp8_linear.py), scales [N/16, 1, 16] float32 per column.
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                         std::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat8_e4m3fn && packed.dim() == 4 && packed.size(2) == kTile &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be contiguous float8_e4m3fn [N/16, K/2, 16, 2]");
  const int64_t n = packed.size(0) * kTile, k = packed.size(1) * 2;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == packed.size(0) && scales.size(1) == 1 && scales.size(2) == kTile,
              "scales must be contiguous float32 [N/16, 1, 16]");
  check_x(x, k, n, bias);
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, n}, x.options());
  const Args a{x.data_ptr<at::BFloat16>(), x.stride(0), k, 1, k, reinterpret_cast<const uint8_t*>(packed.data_ptr()),
               scales.data_ptr<float>(), nullptr, nullptr, bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<at::BFloat16>(), n};
  all_tiles<Fp8>(a, rows, n / kTile);
  return y;
}

// bf16: packed [N/16, K/2, 16, 2] bfloat16 (bf16_tiles.py), for few rows.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, bool prefetch) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kTile &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be contiguous bfloat16 [N/16, K/2, 16, 2]");
  const int64_t n = packed.size(0) * kTile, k = packed.size(1) * 2;
  check_x(x, k, n, bias);
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, n}, x.options());
  const Args a{x.data_ptr<at::BFloat16>(), x.stride(0), k, 1, k, reinterpret_cast<const uint8_t*>(packed.data_ptr()),
               nullptr, nullptr, nullptr, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), n};
  all_tiles<Bf16>(a, rows, n / kTile, prefetch);
  return y;
}

// x rounded to e4m3 at a scale and back (an fp8 checkpoint's activations): static_scale > 0 is the scale;
// otherwise max |x| / 448 over each row (per_token) or over all of x. One pass per row, 32 values at a time.
torch::Tensor fp8_round_input(torch::Tensor x, double static_scale, bool per_token) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 32 == 0,
              "x must be bfloat16 [rows, K] with contiguous rows, K a multiple of 32");
  const int64_t rows = x.size(0), k = x.size(1);
  auto out = torch::empty({rows, k}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  std::vector<float> scales(rows, static_cast<float>(static_scale));
  if (rows == 0) return out;
  if (static_scale <= 0) {
    for (int64_t m = 0; m < rows; ++m) {
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(pagedllm::load16(xp + m * x.stride(0) + i)));
      scales[m] = std::max(_mm512_reduce_max_ps(amax) / 448.0f, 1e-12f);
    }
    if (!per_token) {
      const float all = *std::max_element(scales.begin(), scales.end());
      std::fill(scales.begin(), scales.end(), all);
    }
  }
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads()) if (rows >= 4)
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 sc = _mm512_set1_ps(scales[m]);  // x / scale divided, as torch does (not times 1 / scale)
    alignas(32) uint8_t codes[32];
    for (int64_t i = 0; i < k; i += 32) {
      const at::BFloat16* xr = xp + m * x.stride(0) + i;
      _mm_store_si128(reinterpret_cast<__m128i*>(codes), pagedllm::to_e4m3_16(_mm512_div_ps(pagedllm::load16(xr), sc)));
      _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16),
                      pagedllm::to_e4m3_16(_mm512_div_ps(pagedllm::load16(xr + 16), sc)));
      const __m512i v = _mm512_castps_si512(pagedllm::fp8x32_to_bf16(reinterpret_cast<const c10::Float8_e4m3fn*>(codes)));
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      pagedllm::store16(op + m * k + i, _mm512_mul_ps(lo, sc));
      pagedllm::store16(op + m * k + i + 16, _mm512_mul_ps(hi, sc));
    }
  }
  return out;
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
