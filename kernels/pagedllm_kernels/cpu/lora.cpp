// Batched LoRA delta for bf16 on the CPU, fused: y[t] += (x[t] @ A[slot]^T) @ B[slot] for the tokens of each
// adapter group. A block of up to 4 tokens of one group is shrunk into R fp32 values kept on the stack, then
// expanded straight into those tokens' rows of y: no intermediate tensors, no gather or scatter.
//
//   A [slots, R, in]: rank rows contiguous over the input (AVX512-BF16 dot products, 32 pairs at a time);
//   B [slots, R, out]: block-diagonal by slices. Slice i's rank rows [i * max_rank, i * max_rank + rank) feed
//   its output columns [off[i], off[i + 1]) only, so the zero blocks are never read; ranks past the slot's own
//   rank are skipped too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using pagedllm::load16;
using pagedllm::to_bf16;

constexpr int TB = 4;  // tokens per block
constexpr int RB = 4;  // rank rows per shrink step (TB x RB accumulators)

inline __m512i load32_bf16(const at::BFloat16* p, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, p); }

inline __m512 load16_bf16(const at::BFloat16* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

struct Args {
  const at::BFloat16 *x, *a, *b;
  at::BFloat16* y;
  int64_t x_stride, y_stride, in, out, ranks, max_rank;
  const int64_t* slice_off;
  int64_t num_slices;
};

// s[t][j] = x[rows[t]] . A[j] for the block's tokens and the slot's live rank rows. The loops have fixed trip
// counts, so the TB x RB accumulators stay in registers: a short block repeats its last token (or rank row)
// and drops the copies' results.
void shrink(const Args& g, const at::BFloat16* a, const int64_t* rows, int nt, int64_t rank, float* s) {
  const at::BFloat16* xr[TB];
  for (int t = 0; t < TB; ++t) xr[t] = g.x + rows[std::min(t, nt - 1)] * g.x_stride;
  for (int64_t slice = 0; slice < g.num_slices; ++slice) {
    const int64_t lo = slice * g.max_rank, hi = lo + rank;
    for (int64_t j0 = lo; j0 < hi; j0 += RB) {
      const at::BFloat16* ar[RB];
      for (int r = 0; r < RB; ++r) ar[r] = a + std::min<int64_t>(j0 + r, hi - 1) * g.in;
      __m512 acc[TB][RB];
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t)
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < g.in; k += 32) {
        const __mmask32 m = g.in - k >= 32 ? 0xFFFFFFFFu : ((1u << (g.in - k)) - 1u);
        __m512i xv[TB], av[RB];
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t) xv[t] = load32_bf16(xr[t] + k, m);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) av[r] = load32_bf16(ar[r] + k, m);
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t)
#pragma GCC unroll 4
          for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], (__m512bh)xv[t], (__m512bh)av[r]);
      }
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t)
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r)
          if (t < nt && j0 + r < hi) s[t * g.ranks + j0 + r] = _mm512_reduce_add_ps(acc[t][r]);
    }
  }
}

// y[rows[t], cols of slice i] += sum over the slice's live ranks j of s[t][j] * B[j, cols], 64 columns (4
// vectors) per pass for the TB tokens: 16 accumulators, each B load used TB times.
void expand(const Args& g, const at::BFloat16* b, const int64_t* rows, int nt, int64_t rank, const float* s) {
  constexpr int CV = 4;  // vectors of 16 columns per pass
  at::BFloat16* yr[TB];
  for (int t = 0; t < TB; ++t) yr[t] = g.y + rows[std::min(t, nt - 1)] * g.y_stride;
  for (int64_t slice = 0; slice < g.num_slices; ++slice) {
    const int64_t j0 = slice * g.max_rank, end = g.slice_off[slice + 1];
    for (int64_t c = g.slice_off[slice]; c < end; c += 16 * CV) {
      __mmask16 m[CV];
#pragma GCC unroll 4
      for (int v = 0; v < CV; ++v) {
        const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, end - c - 16 * v));
        m[v] = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u);
      }
      __m512 acc[TB][CV];
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t)
#pragma GCC unroll 4
        for (int v = 0; v < CV; ++v) acc[t][v] = _mm512_setzero_ps();
      for (int64_t j = j0; j < j0 + rank; ++j) {
        __m512 bv[CV];
#pragma GCC unroll 4
        for (int v = 0; v < CV; ++v) bv[v] = load16_bf16(b + j * g.out + c + 16 * v, m[v]);
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t) {
          const __m512 st = _mm512_set1_ps(s[std::min(t, nt - 1) * g.ranks + j]);
#pragma GCC unroll 4
          for (int v = 0; v < CV; ++v) acc[t][v] = _mm512_fmadd_ps(st, bv[v], acc[t][v]);
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        if (t >= nt) break;
#pragma GCC unroll 4
        for (int v = 0; v < CV; ++v) {
          at::BFloat16* yp = yr[t] + c + 16 * v;
          _mm256_mask_storeu_epi16(yp, m[v], to_bf16(_mm512_add_ps(load16_bf16(yp, m[v]), acc[t][v])));
        }
      }
    }
  }
}

}  // namespace

void lora_delta_(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor tokens,
                 torch::Tensor group_start, torch::Tensor group_slot, torch::Tensor slot_rank,
                 torch::Tensor slice_offsets, int64_t max_rank) {
  for (const auto* t : {&y, &x, &a, &b})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, "y, x, a and b must be bf16 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 && x.size(0) == y.size(0),
              "x [T, in] and y [T, out] need contiguous rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
              a.size(1) == b.size(1) && a.size(2) == x.size(1) && b.size(2) == y.size(1),
              "a [slots, R, in] and b [slots, R, out] must be contiguous and fit x and y");
  for (const auto* t : {&tokens, &group_start, &group_slot, &slot_rank, &slice_offsets})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be int64");
  const int64_t num_groups = group_slot.size(0), ranks = a.size(1), num_slices = slice_offsets.size(0) - 1;
  TORCH_CHECK(group_start.size(0) == num_groups + 1 && num_slices * max_rank == ranks &&
              slot_rank.size(0) == a.size(0), "groups, slices and ranks do not agree");
  const int64_t* gs = group_start.data_ptr<int64_t>();
  const int64_t* slot = group_slot.data_ptr<int64_t>();
  const int64_t* rank = slot_rank.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  TORCH_CHECK(gs[0] == 0 && gs[num_groups] == tokens.size(0), "group_start must cover tokens");
  for (int64_t i = 0; i < tokens.size(0); ++i)
    TORCH_CHECK(tok[i] >= 0 && tok[i] < x.size(0), "token row ", tok[i], " is outside x");
  for (int64_t gi = 0; gi < num_groups; ++gi)
    TORCH_CHECK(slot[gi] >= 0 && slot[gi] < a.size(0) && rank[slot[gi]] >= 0 && rank[slot[gi]] <= max_rank,
                "group ", gi, ": bad slot or rank");
  TORCH_CHECK(slice_offsets.data_ptr<int64_t>()[num_slices] == y.size(1), "slice_offsets must end at out");
  // Blocks of up to TB tokens, never spanning two groups (a block shares one slot's weights).
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (first token index, group)
  for (int64_t gi = 0; gi < num_groups; ++gi)
    for (int64_t i = gs[gi]; i < gs[gi + 1]; i += TB) blocks.emplace_back(i, gi);
  const Args g{x.data_ptr<at::BFloat16>(), a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>(),
               y.data_ptr<at::BFloat16>(), x.stride(0), y.stride(0), x.size(1), y.size(1), ranks, max_rank,
               slice_offsets.data_ptr<int64_t>(), num_slices};
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(TB * ranks);
    for (int64_t bi = begin; bi < end; ++bi) {
      const auto [first, gi] = blocks[bi];
      const int nt = static_cast<int>(std::min<int64_t>(TB, gs[gi + 1] - first));
      const int64_t sl = slot[gi], r = rank[sl];
      if (r == 0) continue;
      shrink(g, g.a + sl * ranks * g.in, tok + first, nt, r, s.data());
      expand(g, g.b + sl * ranks * g.out, tok + first, nt, r, s.data());
    }
  });
}
