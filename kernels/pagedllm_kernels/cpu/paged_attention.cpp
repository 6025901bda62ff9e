// Paged attention for CPUs with AVX-512 (and AVX512-BF16) over a mixed batch: each row's last tokens (a decode's
// one, a whole prompt, a chunk after cached positions) attend causally to the row's context, K/V read in place
// through the block table in the layout of kv_layout.h, online softmax block by block, fp32 accumulation. An fp8
// (e4m3) cache is read as bf16 pairs with a bf16 query. The query vectors of one work item (a KV head's query
// heads (GQA), for a tile of a prompt's tokens) are served from one pass over that KV head's run in each block.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "attention_amx.h"
#include "attention_common.h"
#include "kv_layout.h"
#include "ops.h"
#include "simd.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using pagedllm::kUnit;
namespace attention = pagedllm::attention;
using attention::Item;

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxHeads = 128;  // query heads per row
using attention::kMaxBlock;
// Query vectors per item of a prompt's tile (tokens x query heads of a KV head); on the tile unit, its 4 row tiles.
constexpr int kTileSlots = 48;
constexpr int kAmxTileSlots = pagedllm::attention_amx::kMaxSlots;
constexpr int kMaxSlots = kMaxHeads;  // query vectors per item: a decode's heads, or a tile (<= kTileSlots, or a group)
// Query heads per KV head from which decodes, too, go to the tile unit (with amx): one token's heads fill that many
// of a row tile's 16 rows. A decode layer's attention on the 2-core Intel AMX host (perf/README.md, session 29),
// tiles / AVX-512: group 3 1.02-1.17x the time, 4 0.99-1.01x, 5 0.79-0.96x, 7 0.71-0.90x, 8 0.72-0.86x, 16
// 0.48-0.62x.
constexpr int kMinDecodeTileGroup = 5;
// A decode's blocks ahead of the one being attended that are requested whole into L2, across the end of its work
// item into the thread's next one; the next block is also requested into L1, head by head (below). On the 2-core
// AMD Zen 4 host, 125M decode attention streaming its K/V from memory ran 1.28-1.59x as fast as with only the first
// lines of block 2's pages requested (perf/README.md, session 35). Prompt tiles reread their blocks from
// cache (a KV head's tiles run in turn): for them, neither kind of request paid.
constexpr int kL2Ahead = 3;
// Positions a prompt tile's pass covers (a span of whole blocks, below), and the most blocks in one.
constexpr int kSpanPositions = 256;
constexpr int kMaxSpan = kSpanPositions / 16;

// Dot products on 32-bit units (kv_layout.h): fp32 FMAs, or AVX512-BF16 pair dot products (a product of two
// bf16 is exact in fp32 and the sums are fp32, as in SDPA's bf16 path). Vectors hold 16 units as raw bits.
template <typename T>
struct Units;
template <>
struct Units<float> {
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static __m512 dot(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
  static __m512 keep_elements(__m512 v, __mmask32) { return v; }  // a unit is one element: never split
};
template <>
struct Units<at::BFloat16> {
  static __m512 load(const at::BFloat16* p) { return _mm512_loadu_ps(p); }
  static __m512 broadcast(const at::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)));
  }
  static __m512 dot(__m512 acc, __m512 a, __m512 b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static __m512 keep_elements(__m512 v, __mmask32 keep) {
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi16(keep, _mm512_castps_si512(v)));
  }
};

// 16 of the cache's units in the query's format (load), or twice 16 adjacent ones (load2): the query's own
// dtype loads as it is; an fp8 cache's 32 elements become bf16 pairs of the same values (simd.h; a pair of
// vectors widens in fewer instructions than two single ones), the per-tensor scales folded into the score
// scale and the output's normalisation.
template <typename T, typename C>
struct CacheUnits {
  static_assert(std::is_same_v<T, C>, "a cache of another dtype than the query's is fp8 with a bf16 query");
  static __m512 load(const C* p) { return Units<T>::load(p); }
  static void load2(const C* p, __m512& a, __m512& b) {
    a = Units<T>::load(p);
    b = Units<T>::load(p + 16 * kUnit<C>);
  }
};
template <>
struct CacheUnits<at::BFloat16, c10::Float8_e4m3fn> {
  static __m512 load(const c10::Float8_e4m3fn* p) { return pagedllm::fp8x32_to_bf16(p); }
  static void load2(const c10::Float8_e4m3fn* p, __m512& a, __m512& b) { pagedllm::fp8x64_to_bf16(p, a, b); }
};

// Unscaled scores of NG query heads for the 16 tokens c..c+15 of one (block, KV head) K run.
// Two accumulators per head (even and odd units) halve the dependency chains.
template <typename T, typename C, int U, int NG>
inline void scores16(const T* const* qh, const C* kb, int64_t block_size, int64_t c, __m512* s) {
  constexpr int P = kUnit<T>;
  static_assert(kUnit<C> == P, "the cache's units hold as many elements as the query's");
  __m512 even[NG], odd[NG];
  for (int g = 0; g < NG; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  for (int j = 0; j < U; j += 2) {
    __m512 k0, k1;
    if (block_size == 16) {  // units j and j + 1 of the 16 tokens are adjacent
      CacheUnits<T, C>::load2(kb + j * 16 * P, k0, k1);
    } else {
      k0 = CacheUnits<T, C>::load(kb + (j * block_size + c) * P);
      k1 = CacheUnits<T, C>::load(kb + ((j + 1) * block_size + c) * P);
    }
    for (int g = 0; g < NG; ++g) {
      even[g] = Units<T>::dot(even[g], k0, Units<T>::broadcast(qh[g] + j * P));
      odd[g] = Units<T>::dot(odd[g], k1, Units<T>::broadcast(qh[g] + (j + 1) * P));
    }
  }
  for (int g = 0; g < NG; ++g) s[g] = _mm512_add_ps(even[g], odd[g]);
}

// acc[g] += sum over a span's units u0..u1-1 of probs[g] . V, for NG heads with their CH accumulators in
// registers. The span's units lie in runs of per_run units each (its blocks); unit u0 is in the first.
// keep_first/keep_last mask the elements of the edge units that belong to tokens outside the live range
// (their probabilities are 0, but the cache there may hold anything, even NaN).
template <typename T, typename C, int CH, int NG>
inline void weighted_values(const C* const* runs, int64_t per_run, T* const* probs, float* const* acc, int64_t u0,
                            int64_t u1, __mmask32 keep_first, __mmask32 keep_last) {
  constexpr int P = kUnit<T>, D = 16 * CH;
  __m512 a[NG][CH];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CH; ++c) a[g][c] = _mm512_load_ps(acc[g] + 16 * c);
  const C* vr = runs[0] + u0 * D * P;
  for (int64_t u = u0, p = 0, run_end = per_run; u < u1; ++u, vr += D * P) {
    if (u == run_end) {
      vr = runs[++p];
      run_end += per_run;
    }
    static_assert(CH % 2 == 0, "value vectors are loaded in pairs");
    __m512 vv[CH];
    for (int c = 0; c < CH; c += 2) CacheUnits<T, C>::load2(vr + 16 * c * P, vv[c], vv[c + 1]);
    const __mmask32 keep = (u == u0 ? keep_first : ~0u) & (u == u1 - 1 ? keep_last : ~0u);
    if (keep != ~0u)
      for (int c = 0; c < CH; ++c) vv[c] = Units<T>::keep_elements(vv[c], keep);
    for (int g = 0; g < NG; ++g) {
      const __m512 p = Units<T>::broadcast(probs[g] + u * P);
      for (int c = 0; c < CH; ++c) a[g][c] = Units<T>::dot(a[g][c], vv[c], p);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CH; ++c) _mm512_store_ps(acc[g] + 16 * c, a[g][c]);
}

// The two passes for a run-time head count ng <= NG (templates need it at compile time).
template <typename T, typename C, int U, int NG>
inline void scores16_for(int ng, const T* const* qh, const C* kb, int64_t block_size, int64_t c, __m512* s) {
  if constexpr (NG > 1)
    if (ng < NG) return scores16_for<T, C, U, NG - 1>(ng, qh, kb, block_size, c, s);
  scores16<T, C, U, NG>(qh, kb, block_size, c, s);
}
template <typename T, typename C, int CH, int NG>
inline void weighted_values_for(int ng, const C* const* runs, int64_t per_run, T* const* probs, float* const* acc,
                                int64_t u0, int64_t u1, __mmask32 keep_first, __mmask32 keep_last) {
  if constexpr (NG > 1)
    if (ng < NG)
      return weighted_values_for<T, C, CH, NG - 1>(ng, runs, per_run, probs, acc, u0, u1, keep_first, keep_last);
  weighted_values<T, C, CH, NG>(runs, per_run, probs, acc, u0, u1, keep_first, keep_last);
}

template <typename T, typename C, int CH>
void attend_items(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                  const int64_t* seq_lens, const int64_t* query_start, const std::vector<Item>& items, T* out,
                  int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_stride, float scale,
                  int64_t window, float k_scale, float v_scale, bool amx_tiles, bool decode_tiles) {
  constexpr int64_t D = 16 * CH;
  constexpr int P = kUnit<T>, U = static_cast<int>(D) / P;
  constexpr int SB = 8;                 // slots per scores pass
  constexpr int VB = CH <= 4 ? 4 : 2;   // slots per values pass: VB * CH accumulators in registers
  const int64_t group = num_heads / num_kv_heads, run = block_size * D;
  // The cache's values are its elements times these (1 for a cache of the query's dtype).
  const float score_scale = scale * k_scale;
  // An item's blocks [first, end) in its rows' block table: the union of its query tokens' live ranges.
  auto block_span = [&](const Item& it) {
    const int64_t n = query_start[it.row + 1] - query_start[it.row];
    const int64_t first_len = seq_lens[it.row] - (n - 1 - it.t0), last_len = seq_lens[it.row] - (n - it.t1);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first_len - window) : 0;
    return std::pair<int64_t, int64_t>{lo / block_size, (last_len + block_size - 1) / block_size};
  };
  // `next`: the item this thread attends after `it` (nullptr: none), whose first blocks are requested while
  // `it`'s last ones compute.
  auto attend = [&](const Item& it, const Item* next) {
    // Slot s = kv * per_kv + token * group + g: query head (k0 + kv) * group + g of token t0 + token.
    const int64_t per_kv = (it.t1 - it.t0) * group, served = (it.k1 - it.k0) * per_kv;
    const int64_t n = query_start[it.row + 1] - query_start[it.row], len_row = seq_lens[it.row];
    alignas(64) float acc[kMaxSlots][D];  // unnormalised outputs
    alignas(64) float scores[kMaxSlots][kSpanPositions];
    alignas(64) T probs[kMaxSlots][kSpanPositions];  // exp(score - running max), in the cache's dtype
    float running_max[kMaxSlots];
    alignas(64) float denom[kMaxSlots][16];  // partial sums of the softmax denominator
    int64_t first[kMaxSlots], len[kMaxSlots];  // each slot's live positions [first, len) (one KV head's slots)
    const T* qh[kMaxSlots];
    float* acc_h[kMaxSlots];
    T* probs_h[kMaxSlots];
    // bf16 copies of a span's fp8 (block, KV head) runs (the same layout: both keep units of two elements).
    alignas(64) T wide_k[std::is_same_v<T, C> ? 1 : kSpanPositions * D],
        wide_v[std::is_same_v<T, C> ? 1 : kSpanPositions * D];
    for (int64_t s = 0; s < served; ++s) {
      const int64_t kv = s / per_kv, tok = it.t0 + (s % per_kv) / group, g = s % group;
      qh[s] = q + (query_start[it.row] + tok) * q_stride + ((it.k0 + kv) * group + g) * D;
      acc_h[s] = acc[s];
      for (int c = 0; c < CH; ++c) _mm512_store_ps(acc[s] + 16 * c, _mm512_setzero_ps());
      running_max[s] = -std::numeric_limits<float>::infinity();
      _mm512_store_ps(denom[s], _mm512_setzero_ps());
    }
    for (int64_t j = 0; j < per_kv; ++j) {
      probs_h[j] = probs[j];
      len[j] = len_row - (n - 1 - (it.t0 + j / group));
      first[j] = window > 0 ? std::max<int64_t>(0, len[j] - window) : 0;
    }
    const int64_t lo = first[0], hi = len[per_kv - 1];  // the union of the slots' ranges
    const int64_t* table = block_tables + it.row * table_stride;
    const int64_t end_block = block_span(it).second;
    const auto next_span = next != nullptr ? block_span(*next) : std::pair<int64_t, int64_t>{};
    const bool decode = it.t1 - it.t0 == 1;
    const int64_t l2_ahead = decode ? kL2Ahead : 0;
    // A pass covers a span of blocks: for a prompt's tile, up to kSpanPositions positions of consecutive blocks
    // (each its own run), so the softmax step, the accumulators' loads and stores and the per-pass setup are paid
    // once per span, not per block. On the 2-core Zen 4 host, prompts of 144-2,048 tokens in blocks of 16 ran
    // 1.20-1.38x as fast as block by block; spans of 64 positions 1.17-1.24x, of 512 no faster than 256
    // (perf/README.md, session 36). A decode's span is one block: its prefetches below are planned block by block.
    const int64_t span_blocks = decode ? 1 : std::max<int64_t>(1, kSpanPositions / block_size);
    for (int64_t start = lo - lo % block_size; start < hi; start += span_blocks * block_size) {
      const int64_t idx = start / block_size;
      const int64_t blocks =
          span_blocks == 1 ? 1 : std::min(span_blocks, (hi - start + block_size - 1) / block_size);
      int64_t base[kMaxSpan];  // each block's run of the item's first KV head
      for (int64_t p = 0; p < blocks; ++p) base[p] = (table[idx + p] * num_kv_heads + it.k0) * run;
      // Blocks are scattered: the one after the span is requested while this one computes, each KV head's share
      // just before that head's work here (below), every line (no adjacent-line help). Spread out so, decode
      // attention ran 1.13-1.27x as fast as with the whole block requested at once (perf/README.md, session 19).
      const char* kn = nullptr;
      const char* vn = nullptr;
      if (start + blocks * block_size < hi) {
        const int64_t near = (table[idx + blocks] * num_kv_heads + it.k0) * run;
        kn = reinterpret_cast<const char*>(k_cache + near);
        vn = reinterpret_cast<const char*>(v_cache + near);
      }
      // A decode's blocks 2..kL2Ahead ahead into L2; at the item's end, the next item's first blocks instead
      // (the block right after this item's last, too, as no L1 request above covers it). Written out here: GCC 12
      // dropped these requests when a helper lambda made them.
      for (int64_t ahead = 1; ahead <= l2_ahead; ++ahead) {
        const Item* target_item = &it;
        int64_t target = idx + ahead;
        if (target >= end_block) {
          target_item = next;
          target = next_span.first + (target - end_block);
          if (next == nullptr || target >= next_span.second) continue;
        } else if (ahead < 2) {
          continue;
        }
        const int64_t at =
            (block_tables[target_item->row * table_stride + target] * num_kv_heads + target_item->k0) * run;
        const char* kf = reinterpret_cast<const char*>(k_cache + at);
        const char* vf = reinterpret_cast<const char*>(v_cache + at);
        const int64_t bytes = (target_item->k1 - target_item->k0) * run * static_cast<int64_t>(sizeof(C));
        for (int64_t off = 0; off < bytes; off += 64) {
          _mm_prefetch(kf + off, _MM_HINT_T1);
          _mm_prefetch(vf + off, _MM_HINT_T1);
        }
      }
      // The span's live positions [a, b), relative to its start: a is in its first block (only the first span
      // starts before lo, by less than a block).
      const int64_t a = std::max(start, lo) - start, b = std::min(start + blocks * block_size, hi) - start;
      const int64_t c0 = a - a % 16, u0 = a / P, u1 = (b + P - 1) / P;
      // bf16: an edge unit (a token pair) may hold a position outside [a, b), which may not be written yet:
      // keep only the live one's elements. Inside [a, b) every position is written; a slot's dead ones there
      // get probability 0.
      const __mmask32 keep_first = (a % P) ? 0xAAAAAAAAu : ~0u, keep_last = (b % P) ? 0x55555555u : ~0u;
      for (int64_t kvh = it.k0; kvh < it.k1; ++kvh) {
        const C* kr[kMaxSpan];
        const C* vr[kMaxSpan];
        for (int64_t p = 0; p < blocks; ++p) {
          kr[p] = k_cache + base[p] + (kvh - it.k0) * run;
          vr[p] = v_cache + base[p] + (kvh - it.k0) * run;
        }
        const int64_t s0 = (kvh - it.k0) * per_kv;  // this KV head's first slot
        if (kn != nullptr) {
          const int64_t o0 = (kvh - it.k0) * run * static_cast<int64_t>(sizeof(C));
          for (int64_t off = o0; off < o0 + run * static_cast<int64_t>(sizeof(C)); off += 64) {
            _mm_prefetch(kn + off, _MM_HINT_T0);
            _mm_prefetch(vn + off, _MM_HINT_T0);
          }
        }
        // A pass over the span's runs of the cache, given the runs: fp8 runs that more than one pass reads are
        // widened once, into bf16 scratch, and the passes read that; otherwise they read (and widen) the cache
        // itself.
        auto read_runs = [&](const C* const* r, T* scratch, bool several_passes, auto&& pass) {
          if constexpr (!std::is_same_v<T, C>) {
            if (several_passes) {
              const T* wide[kMaxSpan];
              for (int64_t p = 0; p < blocks; ++p) {
                attention::widen_run(r[p], scratch + p * run, run);
                wide[p] = scratch + p * run;
              }
              return pass(static_cast<const T* const*>(wide));
            }
          }
          pass(r);
        };
        auto scores_pass = [&]<typename K>(const K* const* runs) {
          for (int64_t j0 = 0; j0 < per_kv; j0 += SB) {
            const int ng = static_cast<int>(std::min<int64_t>(SB, per_kv - j0));
            // c: the chunk's position in the span; p and at: its block in the span and its position there.
            for (int64_t c = c0, p = 0, at = c0; c < b; c += 16, at += 16) {
              if (at == block_size) {
                ++p;
                at = 0;
              }
              __m512 sc[SB];
              scores16_for<T, K, U, SB>(ng, qh + s0 + j0, runs[p], block_size, at, sc);
              for (int g = 0; g < ng; ++g)
                _mm512_store_ps(scores[j0 + g] + c, sc[g]);
            }
          }
        };
        read_runs(kr, wide_k, per_kv > SB, scores_pass);
        for (int64_t j = 0; j < per_kv; ++j)
          attention::online_softmax_step<T, CH>(scores[j], probs[j], c0, b, std::max(a, first[j] - start),
                                                std::min(b, len[j] - start), score_scale, running_max[s0 + j],
                                                denom[s0 + j], acc[s0 + j]);
        auto values_pass = [&]<typename V>(const V* const* runs) {
          for (int64_t j0 = 0; j0 < per_kv; j0 += VB)
            weighted_values_for<T, V, CH, VB>(static_cast<int>(std::min<int64_t>(VB, per_kv - j0)), runs,
                                              block_size / P, probs_h + j0, acc_h + s0 + j0, u0, u1, keep_first,
                                              keep_last);
        };
        read_runs(vr, wide_v, per_kv > VB, values_pass);
      }
    }
    for (int64_t s = 0; s < served; ++s) {
      const int64_t kv = s / per_kv, tok = it.t0 + (s % per_kv) / group, g = s % group;
      T* o = out + ((query_start[it.row] + tok) * num_heads + (it.k0 + kv) * group + g) * D;
      attention::write_output<T, CH>(o, acc[s], denom[s], v_scale);
    }
  };
  // With amx_tiles, prompt tiles (items of several tokens) go to the tile unit; decodes too with decode_tiles
  // (a group of kMinDecodeTileGroup or more), else they stay here: one token's query heads fill too little of a
  // tile.
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const bool tiles = kBf16 && amx_tiles;
  pagedllm::attention_amx::Operands<C> operands{};
  if constexpr (kBf16)
    operands = {q, q_stride, k_cache, v_cache, block_tables, seq_lens, query_start, out, num_heads, num_kv_heads,
                block_size, table_stride, window, score_scale, v_scale};
  // Items differ in length by up to the context length: hand them out one at a time, not in equal ranges. A thread
  // claims its next item when it starts one, so that it can request the next one's first blocks in time.
  const int threads = at::get_num_threads();
  std::atomic<size_t> claimed{0};
#pragma omp parallel num_threads(threads)
  {
    if (tiles) pagedllm::attention_amx::configure_tiles(block_size);
    for (size_t i = claimed.fetch_add(1); i < items.size();) {
      const size_t next = claimed.fetch_add(1);
      const Item* next_item = next < items.size() ? &items[next] : nullptr;
      bool on_tiles = false;
      if constexpr (kBf16) {
        on_tiles = tiles && (items[i].t1 - items[i].t0 > 1 || decode_tiles);
        if (on_tiles) pagedllm::attention_amx::attend<C, CH>(items[i], operands);
      }
      if (!on_tiles) attend(items[i], next_item);
      i = next;
    }
    if (tiles) _tile_release();
  }
}

// The work items of a batch. A one-token row (a decode) is one item with all its KV heads, so each block is read
// as one contiguous run and prefetched whole; with few rows, or with decode_tiles (the tile unit takes one KV head
// an item), one item per (row, KV head), so every thread has work. A row of several tokens is cut into tiles of
// tile_slots / group tokens, one KV head each.
std::vector<Item> plan_items(const int64_t* query_start, int64_t rows, int64_t heads, int64_t kv_heads,
                             int64_t tile_slots, bool decode_tiles) {
  const int64_t group = heads / kv_heads, tile = std::max<int64_t>(1, tile_slots / group);
  int64_t single = 0;
  for (int64_t r = 0; r < rows; ++r) single += query_start[r + 1] - query_start[r] == 1;
  const int64_t heads_per_item = single >= 4 * at::get_num_threads() && !decode_tiles ? kv_heads : 1;
  std::vector<Item> items;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = query_start[r + 1] - query_start[r];
    if (n == 1) {
      for (int64_t k0 = 0; k0 < kv_heads; k0 += heads_per_item) items.push_back({r, 0, 1, k0, k0 + heads_per_item});
      continue;
    }
    // KV head by KV head, so the threads' next items read the run their last ones left in cache; and last tiles
    // first: they attend the longest context, and a thread that takes one last idles the longest.
    for (int64_t k = 0; k < kv_heads; ++k)
      for (int64_t t1 = n; t1 > 0; t1 -= tile) items.push_back({r, std::max<int64_t>(0, t1 - tile), t1, k, k + 1});
  }
  return items;
}

template <typename T, typename C>
void dispatch_head_dim(const T* q, int64_t q_stride, const C* k, const C* v, const int64_t* tables,
                       const int64_t* lens, const int64_t* query_start, const std::vector<Item>& items, T* out,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t table_stride,
                       float scale, int64_t window, float k_scale, float v_scale, bool amx_tiles,
                       bool decode_tiles) {
#define PAGEDLLM_CASE(CH)                                                                                    \
  case 16 * CH:                                                                                              \
    return attend_items<T, C, CH>(q, q_stride, k, v, tables, lens, query_start, items, out, heads, kv_heads, \
                                  block_size, table_stride, scale, window, k_scale, v_scale, amx_tiles, decode_tiles);
  switch (head_dim) {
    PAGEDLLM_CASE(2)
    PAGEDLLM_CASE(4)
    PAGEDLLM_CASE(6)
    PAGEDLLM_CASE(8)
    default:
      TORCH_CHECK(false, "head_dim must be 32, 64, 96 or 128, got ", head_dim);
  }
#undef PAGEDLLM_CASE
}

}  // namespace

// q [tokens, H, D] (tokens may be strided); row r's tokens are q[query_start[r]:query_start[r + 1]], the last
// ones of its sequence: the row's token i of n sees its first seq_lens[r] - (n - 1 - i) positions. k_cache,
// v_cache [blocks, block_size, KVH, D] contiguous, in the layout of kv_layout.h, of q's dtype or (with a bf16
// q) float8_e4m3fn; block_tables [rows, max_blocks] int64; seq_lens [rows] int64; query_start [rows + 1] int64;
// window <= 0: none; amx: prompt tiles, and decodes of kMinDecodeTileGroup or more query heads per KV head, on
// the AMX tile unit (attention_amx.h) where it applies (a bf16 q, block sizes 16, 32 or 64). Returns
// [tokens, H, D] in q's dtype.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start, double scale, int64_t window,
                              double k_scale, double v_scale, bool amx) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, head_dim]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() || (fp8 && q.scalar_type() == at::kBFloat16)),
              "the caches must be q's dtype, or float8_e4m3fn with a bfloat16 q");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  query_start.is_contiguous() && block_tables.stride(1) == 1,
              "block_tables, seq_lens and query_start must be int64 (block_tables row-major)");
  const int64_t rows = seq_lens.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "q and the cache disagree on head_dim");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && heads <= kMaxHeads,
              "heads must be a multiple of kv_heads, at most 16 per KV head and 128 in all");
  TORCH_CHECK(block_size % 16 == 0 && block_size <= kMaxBlock, "block_size must be 16, 32, 48 or 64");
  TORCH_CHECK(block_tables.size(0) == rows && query_start.size(0) == rows + 1,
              "one block table and length per row, and rows + 1 query starts");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "scales must be positive");
  TORCH_CHECK(!amx || pagedllm::amx_permitted(), "AMX tiles were asked for, but this CPU or process has none");
  const bool amx_tiles = amx && q.scalar_type() == at::kBFloat16 &&
                         pagedllm::attention_amx::block_size_supported(block_size);
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[rows] == q.size(0), "query_start must run from 0 to the token count");
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = starts[r + 1] - starts[r];
    TORCH_CHECK(n >= 1 && n <= lens[r], "row ", r, ": ", n, " query tokens for a context of ", lens[r]);
    TORCH_CHECK(-(-lens[r] / block_size) <= block_tables.size(1), "row ", r, ": its context needs more blocks than "
                "its table has");
  }
  auto out = torch::empty({q.size(0), heads, head_dim}, q.options());
  const bool decode_tiles = amx_tiles && heads / kv_heads >= kMinDecodeTileGroup;
  const std::vector<Item> items = plan_items(starts, rows, heads, kv_heads, amx_tiles ? kAmxTileSlots : kTileSlots,
                                             decode_tiles);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const float s = static_cast<float>(scale), ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  const int64_t ts = block_tables.stride(0);
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float, float>(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(),
                                    v_cache.data_ptr<float>(), tables, lens, starts, items, out.data_ptr<float>(),
                                    heads, kv_heads, head_dim, block_size, ts, s, window, 1.0f, 1.0f, false, false);
  } else if (fp8) {
    dispatch_head_dim<at::BFloat16, c10::Float8_e4m3fn>(
        q.data_ptr<at::BFloat16>(), q.stride(0), k_cache.data_ptr<c10::Float8_e4m3fn>(),
        v_cache.data_ptr<c10::Float8_e4m3fn>(), tables, lens, starts, items, out.data_ptr<at::BFloat16>(), heads,
        kv_heads, head_dim, block_size, ts, s, window, ks, vs, amx_tiles, decode_tiles);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "dtype must be float32 or bfloat16");
    dispatch_head_dim<at::BFloat16, at::BFloat16>(
        q.data_ptr<at::BFloat16>(), q.stride(0), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
        tables, lens, starts, items, out.data_ptr<at::BFloat16>(), heads, kv_heads, head_dim, block_size, ts, s,
        window, 1.0f, 1.0f, amx_tiles, decode_tiles);
  }
  return out;
}
