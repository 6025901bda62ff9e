// Structured output's token masks applied to logits rows in place: one masked store of -inf per 32 tokens
// (AVX-512), reading the grammar engine's bitmask as it is (bit t of a row set = token t allowed), instead of
// expanding the bits into a bool tensor and masking through it (~2 ms for 32 rows of a 32k vocabulary here).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#include "ops.h"

namespace {

// Tokens past the bitmask's width are not allowed (the grammar knows nothing of them).
template <typename T>
void mask_rows(T* logits, int64_t vocab, const int64_t* rows, const uint32_t* bits, int64_t num_rows,
               int64_t words) {
  const int64_t chunks = (vocab + 31) / 32;
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    const __m512 ninf32 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512i ninf16 = _mm512_set1_epi16(static_cast<int16_t>(0xFF80));  // bf16 -inf
    for (int64_t j = begin; j < end; ++j) {
      T* row = logits + rows[j] * vocab;
      const uint32_t* b = bits + j * words;
      for (int64_t w = 0; w < chunks; ++w) {
        const int64_t n = std::min<int64_t>(32, vocab - 32 * w);
        const uint32_t lanes = n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
        const uint32_t banned = ~(w < words ? b[w] : 0u) & lanes;
        if (!banned) continue;
        T* at = row + 32 * w;
        if constexpr (sizeof(T) == 2) {
          _mm512_mask_storeu_epi16(at, static_cast<__mmask32>(banned), ninf16);
        } else {  // masked-off lanes are never touched, past the row's end included
          _mm512_mask_storeu_ps(at, static_cast<__mmask16>(banned & 0xFFFFu), ninf32);
          _mm512_mask_storeu_ps(at + 16, static_cast<__mmask16>(banned >> 16), ninf32);
        }
      }
    }
  });
}

}  // namespace

void mask_logits_(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(),
              "logits must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64 [R]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
              bitmask.size(0) == rows.size(0), "bitmask must be a contiguous int32 [R, words] tensor");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j)
    TORCH_CHECK(r[j] >= 0 && r[j] < logits.size(0), "row ", r[j], " is outside the logits' ", logits.size(0));
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  if (logits.scalar_type() == at::kFloat)
    mask_rows<float>(logits.data_ptr<float>(), logits.size(1), r, bits, rows.size(0), bitmask.size(1));
  else
    mask_rows<at::BFloat16>(logits.data_ptr<at::BFloat16>(), logits.size(1), r, bits, rows.size(0),
                            bitmask.size(1));
}
