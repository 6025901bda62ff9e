// The paged attention kernel's prompt tiles on CPUs with AMX (paged_attention.cpp chooses where; decodes of wide
// GQA groups too): one work item is a tile of a row's tokens times the query heads of one KV head, up to 64 query
// vectors ("slots", padded to row tiles of 16), and both of its products run on the tile unit, reading the cache
// in place:
//   scores = Q K^T: kv_layout.h's K run is [head_dim / 2][block_size][2], which is already the B operand's
//            layout (pairs of dims by positions), 16 positions at a time;
//   out += P V:    its V run is [block_size / 2][head_dim][2], the B operand's layout for pairs of positions by
//            dims, up to 32 positions at a time.
// Between them the AVX-512 path's online softmax (attention_common.h), over spans of up to 128 positions (2-8
// blocks), so its rescaling and the accumulators' round trip through the tiles come once per span. A span is
// taken a row tile at a time (scores, softmax, values), which keeps its scratch (scores and weights of 16 slots)
// in L1 beside the span's K and V runs.
#pragma once

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include "amx_tiles.h"
#include "attention_common.h"
#include "kv_layout.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace pagedllm::attention_amx {

using attention::Item;
using Bf16 = at::BFloat16;

constexpr int kMaxSlots = 64;  // query vectors per item: 4 row tiles
// Positions per online-softmax step: 128 took 0.91-0.95x the time of 64 (a 1,500-token prompt; its per-slot
// overheads come half as often).
constexpr int kSpan = 128;
using attention::kMaxBlock;

// Block sizes the tiles take: whole 16-position chunks, and spans of whole blocks.
inline bool block_size_supported(int64_t block_size) {
  return block_size == 16 || block_size == 32 || block_size == 64;
}

// Tiles 0-3: fp32 accumulators (a row tile's scores for 16 positions each, or its outputs for 16 dims); 4: Q
// (16 slots by 32 dims); 5: K (16 pairs of dims by 16 positions); 6: P (16 slots by kc positions); 7: V (kc / 2
// pairs of positions by 16 dims); kc = min(block_size, 32). Loaded by each thread before its first item.
inline void configure_tiles(int64_t block_size) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  const int kc = static_cast<int>(std::min<int64_t>(block_size, 32));
  cfg.rows[6] = 16;
  cfg.colsb[6] = static_cast<uint16_t>(kc * 2);
  cfg.rows[7] = static_cast<uint8_t>(kc / 2);
  cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
}

// f.operator()<i>() for i = 0..N-1.
template <int N, typename F>
inline void unrolled(F&& f) {
  [&]<int... i>(std::integer_sequence<int, i...>) { (f.template operator()<i>(), ...); }(
      std::make_integer_sequence<int, N>{});
}

// The accumulator tiles 0-3 by a template argument (the intrinsics take tile numbers as literals): zeroed,
// loaded, stored, and multiplied into by Q K (tiles 4, 5) or by P V (tiles 6, 7).
template <int t> void zero_acc();
template <int t> void load_acc(const void* p, int64_t stride);
template <int t> void store_acc(void* p, int64_t stride);
template <int t> void add_scores();
template <int t> void add_values();
#define PAGEDLLM_ACC_TILE(t)                                                                         \
  template <> inline void zero_acc<t>() { _tile_zero(t); }                                           \
  template <> inline void load_acc<t>(const void* p, int64_t stride) { _tile_loadd(t, p, stride); }  \
  template <> inline void store_acc<t>(void* p, int64_t stride) { _tile_stored(t, p, stride); }      \
  template <> inline void add_scores<t>() { _tile_dpbf16ps(t, 4, 5); }                               \
  template <> inline void add_values<t>() { _tile_dpbf16ps(t, 6, 7); }
PAGEDLLM_ACC_TILE(0)
PAGEDLLM_ACC_TILE(1)
PAGEDLLM_ACC_TILE(2)
PAGEDLLM_ACC_TILE(3)
#undef PAGEDLLM_ACC_TILE

// A block's V run in bf16 with the positions outside [x0, x1) zeroed: there the probabilities are 0, but the
// cache may hold anything (even NaN, and 0 * NaN is NaN). Units are pairs of positions (kv_layout.h).
template <typename C>
inline void clean_values(const C* src, Bf16* dst, int64_t block_size, int64_t head_dim, int64_t x0, int64_t x1) {
  const int64_t row = head_dim * 2;  // elements of one pair of positions
  for (int64_t p = 0; p < block_size / 2; ++p) {
    const bool even = 2 * p >= x0 && 2 * p < x1, odd = 2 * p + 1 >= x0 && 2 * p + 1 < x1;
    const __mmask32 keep = (even ? 0x55555555u : 0u) | (odd ? 0xAAAAAAAAu : 0u);
    for (int64_t e = 0; e < row; e += 32) {
      __m512i v;
      if constexpr (std::is_same_v<C, Bf16>)
        v = _mm512_loadu_si512(src + p * row + e);
      else
        v = _mm512_castps_si512(pagedllm::fp8x32_to_bf16(src + p * row + e));
      _mm512_store_si512(dst + p * row + e, _mm512_maskz_mov_epi16(keep, v));
    }
  }
}

// One call's operands, as the kernel's entry point checked them.
template <typename C>
struct Operands {
  const Bf16* q;
  int64_t q_stride;
  const C *k_cache, *v_cache;
  const int64_t *block_tables, *seq_lens, *query_start;
  Bf16* out;
  int64_t num_heads, num_kv_heads, block_size, table_stride, window;
  float score_scale, v_scale;  // the scores' scale (k_scale folded in); the values' (an fp8 cache's v_scale)
};

// One item of R row tiles (16 * (R - 1) < slots <= 16 * R); k1 == k0 + 1. The threads' tiles are configured.
template <typename C, int CH, int R>
void attend_tile(const Item& it, const Operands<C>& o) {
  constexpr int64_t D = 16 * CH, S = 16 * R;
  const int64_t group = o.num_heads / o.num_kv_heads, bs = o.block_size, run = bs * D;
  const int64_t tokens = it.t1 - it.t0, slots = tokens * group;
  const int64_t n = o.query_start[it.row + 1] - o.query_start[it.row], len_row = o.seq_lens[it.row];
  const int64_t kc = std::min<int64_t>(bs, 32), span_len = (kSpan / bs) * bs;
  alignas(64) Bf16 qs[S][D];          // slot s = token * group + g: query head k0 * group + g of token t0 + token
  alignas(64) float acc[S][D];        // unnormalised outputs
  alignas(64) float scores[16][kSpan];  // one row tile's
  alignas(64) Bf16 probs[16][kSpan];
  alignas(64) float denom[S][16];
  alignas(64) Bf16 wide_k[std::is_same_v<C, Bf16> ? 1 : kSpan * D];  // an fp8 span's K as bf16
  alignas(64) Bf16 clean_v[kSpan * D];  // the span's edge blocks' V (and every fp8 block's), cleaned
  float running_max[S];
  int64_t first[S], len[S];  // each slot's live positions [first, len)
  for (int64_t i = 0; i < tokens; ++i)
    std::memcpy(qs[i * group], o.q + (o.query_start[it.row] + it.t0 + i) * o.q_stride + it.k0 * group * D,
                group * D * sizeof(Bf16));
  // Padding slots: zero queries (and weights, below), so their accumulators (never written out) stay finite.
  std::memset(qs[slots], 0, (S - slots) * D * sizeof(Bf16));
  std::memset(acc, 0, sizeof acc);
  std::memset(denom, 0, sizeof denom);
  for (int64_t s = 0; s < slots; ++s) {
    running_max[s] = -std::numeric_limits<float>::infinity();
    len[s] = len_row - (n - 1 - (it.t0 + s / group));
    first[s] = o.window > 0 ? std::max<int64_t>(0, len[s] - o.window) : 0;
  }
  const int64_t lo = first[0], hi = len[slots - 1];  // the union of the slots' ranges
  const int64_t* table = o.block_tables + it.row * o.table_stride;
  auto run_of = [&](const C* cache, int64_t position) {
    return cache + (table[position / bs] * o.num_kv_heads + it.k0) * run;
  };
  for (int64_t span = lo - lo % bs; span < hi; span += span_len) {
    // Live positions [a, b) of the span (relative to it), and the 16-position chunks they touch.
    const int64_t a = std::max(span, lo) - span, b = std::min(span + span_len, hi) - span;
    const int64_t c_lo = a - a % 16, c_hi = (b + 15) / 16 * 16;
    // Blocks are scattered: request the next span's K and V runs while this one computes (a decode's item is
    // bound by memory: decode attention at 7 query heads per KV head took 0.86-0.93x the time with this as
    // without). Only for a row's last tile, the first of its tiles to run (plan_items orders them last first; a
    // decode is its row's only tile): the later tiles find the runs in L2, and their requests cost more than they
    // saved (a 1,024-token prompt's attention took 0.94x the time without them; prompts on cold caches 0.97x).
    if (it.t1 == n) {
      for (int64_t next = span + span_len; next < std::min(span + 2 * span_len, hi); next += bs) {
        const char* kn = reinterpret_cast<const char*>(run_of(o.k_cache, next));
        const char* vn = reinterpret_cast<const char*>(run_of(o.v_cache, next));
        for (int64_t off = 0; off < run * static_cast<int64_t>(sizeof(C)); off += 64) {
          _mm_prefetch(kn + off, _MM_HINT_T0);
          _mm_prefetch(vn + off, _MM_HINT_T0);
        }
      }
    }
    // The span's K runs: in place (bf16), or widened to bf16 once for all the row tiles (fp8).
    const Bf16* kb[kSpan / 16];
    for (int64_t blk = c_lo / bs; blk * bs < c_hi; ++blk) {
      if constexpr (std::is_same_v<C, Bf16>) {
        kb[blk] = run_of(o.k_cache, span + blk * bs);
      } else {
        attention::widen_run(run_of(o.k_cache, span + blk * bs), wide_k + blk * run, run);
        kb[blk] = wide_k + blk * run;
      }
    }
    // The values read whole kc-position chunks: their positions outside [c_lo, c_hi) get probability 0 too.
    const int64_t k_lo = a - a % kc, k_hi = (b + kc - 1) / kc * kc;
    // The span's V runs: in place where every position of a chunk read is live, else a cleaned copy.
    const Bf16* vb[kSpan / 16];
    for (int64_t blk = a / bs; blk * bs < b; ++blk) {
      const int64_t x0 = std::max<int64_t>(a - blk * bs, 0), x1 = std::min<int64_t>(b - blk * bs, bs);
      const C* v = run_of(o.v_cache, span + blk * bs);
      if (std::is_same_v<C, Bf16> && x0 == 0 && x1 == bs) {
        vb[blk] = reinterpret_cast<const Bf16*>(v);
      } else {
        clean_values(v, clean_v + blk * run, bs, D, x0, x1);
        vb[blk] = clean_v + blk * run;
      }
    }
    // Row tile by row tile: its scores, softmax, and out += P V.
    unrolled<R>([&]<int m>() {
      const int64_t s0 = 16 * m, s1 = std::min<int64_t>(slots, s0 + 16);
      // Scores, up to 4 chunks of 16 positions (accumulator tiles 0-3) at a time, 32 dims of K per step.
      for (int64_t c = c_lo; c < c_hi; c += 64) {
        const int64_t nc = std::min<int64_t>(4, (c_hi - c) / 16);
        unrolled<4>([&]<int j>() { if (j < nc) zero_acc<j>(); });
        for (int64_t dc = 0; dc < D / 32; ++dc) {
          _tile_loadd(4, qs[s0] + dc * 32, D * sizeof(Bf16));
          unrolled<4>([&]<int j>() {
            if (j < nc) {
              const int64_t pos = c + 16 * j;
              _tile_loadd(5, kb[pos / bs] + (dc * 16 * bs + pos % bs) * 2, bs * 2 * sizeof(Bf16));
              add_scores<j>();
            }
          });
        }
        unrolled<4>([&]<int j>() { if (j < nc) store_acc<j>(scores[0] + c + 16 * j, kSpan * sizeof(float)); });
      }
      for (int64_t s = s0; s < s1; ++s) {
        attention::online_softmax_step<Bf16, CH>(scores[s - s0], probs[s - s0], c_lo, b,
                                                 std::max(a, first[s] - span), std::min(b, len[s] - span),
                                                 o.score_scale, running_max[s], denom[s], acc[s]);
        std::fill(probs[s - s0] + k_lo, probs[s - s0] + c_lo, Bf16(0.0f));
        std::fill(probs[s - s0] + c_hi, probs[s - s0] + k_hi, Bf16(0.0f));
      }
      // A last tile's padding slots: weights 0, so their accumulators (never written out) stay finite.
      for (int64_t s = s1; s < s0 + 16; ++s) std::fill(probs[s - s0] + k_lo, probs[s - s0] + k_hi, Bf16(0.0f));
      // out += P V, up to 64 dims (4 accumulator tiles) at a time.
      auto values = [&]<int ND>(int64_t d0) {
        unrolled<ND>([&]<int j>() { load_acc<j>(acc[s0] + d0 + 16 * j, D * sizeof(float)); });
        for (int64_t p = k_lo; p < k_hi; p += kc) {
          _tile_loadd(6, probs[0] + p, kSpan * sizeof(Bf16));
          const Bf16* v = vb[p / bs] + ((p % bs) / 2) * D * 2;
          unrolled<ND>([&]<int j>() {
            _tile_loadd(7, v + (d0 + 16 * j) * 2, D * 2 * sizeof(Bf16));
            add_values<j>();
          });
        }
        unrolled<ND>([&]<int j>() { store_acc<j>(acc[s0] + d0 + 16 * j, D * sizeof(float)); });
      };
      for (int64_t d0 = 0; d0 + 64 <= D; d0 += 64) values.template operator()<4>(d0);
      if constexpr (D % 64 != 0) values.template operator()<2>(D - 32);
    });
  }
  for (int64_t s = 0; s < slots; ++s) {
    Bf16* out = o.out + ((o.query_start[it.row] + it.t0 + s / group) * o.num_heads + it.k0 * group + s % group) * D;
    attention::write_output<Bf16, CH>(out, acc[s], denom[s], o.v_scale);
  }
}

// One item, its row tiles chosen at run time.
template <typename C, int CH>
void attend(const Item& it, const Operands<C>& o) {
  const int64_t slots = (it.t1 - it.t0) * (o.num_heads / o.num_kv_heads);
  switch ((slots + 15) / 16) {
    case 1: return attend_tile<C, CH, 1>(it, o);
    case 2: return attend_tile<C, CH, 2>(it, o);
    case 3: return attend_tile<C, CH, 3>(it, o);
    default: return attend_tile<C, CH, 4>(it, o);
  }
}

}  // namespace pagedllm::attention_amx
