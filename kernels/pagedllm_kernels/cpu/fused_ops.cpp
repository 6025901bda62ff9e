// Fused elementwise ops for the bf16 CPU decoder, each one pass over memory instead of several torch ops
// and temporaries. Rounding follows the torch ops they replace (each intermediate a bf16 tensor would hold
// is rounded to bf16), so results match them to the last bit or one unit in the last place.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "ops.h"
#include "simd.h"

using pagedllm::exp16;
using pagedllm::load16;
using pagedllm::round_to;
using pagedllm::store16;

namespace {

template <typename T>
float as_float(T v) { return static_cast<float>(v); }

// y = weight * round(s * rsqrt(mean(s^2) + eps)), statistics in fp32, where s = x; or, given a residual,
// s = round(x + residual), stored back into the residual first (the decoder's residual add and the next norm
// in one pass, rounded as the two torch ops round). y may be x: a row's x is read before its y is written.
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* w, T* y, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      T* rr = residual ? residual + r * h : nullptr;
      const T* sr = rr ? rr : xr;  // s
      T* yr = y + r * h;
      __m512 ss = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= h; i += 16) {
        __m512 v = load16(xr + i);
        if (rr) {
          v = round_to(xr, _mm512_add_ps(v, load16(rr + i)));
          store16(rr + i, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      float sum = _mm512_reduce_add_ps(ss);
      for (int64_t j = i; j < h; ++j) {
        if (rr) rr[j] = T(as_float(xr[j]) + as_float(rr[j]));
        sum += as_float(sr[j]) * as_float(sr[j]);
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
      for (i = 0; i + 16 <= h; i += 16) {
        const __m512 n = round_to(xr, _mm512_mul_ps(load16(sr + i), _mm512_set1_ps(inv)));
        store16(yr + i, _mm512_mul_ps(load16(w + i), n));
      }
      for (int64_t j = i; j < h; ++j) yr[j] = T(as_float(w[j]) * as_float(T(as_float(sr[j]) * inv)));
    }
  });
}

// y = round(silu(gate)) * up for x = [gate | up] per row.
template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * inter;
      const T* up = gate + inter;
      T* yr = y + r * inter;
      int64_t i = 0;
      for (; i + 16 <= inter; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 one = _mm512_set1_ps(1.0f);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(yr + i, _mm512_mul_ps(round_to(gate, s), load16(up + i)));
      }
      for (int64_t j = i; j < inter; ++j) {
        const float g = as_float(gate[j]);
        yr[j] = T(as_float(T(g / (1.0f + std::exp(-g)))) * as_float(up[j]));
      }
    }
  });
}

// In place, the HF "rotate half" layout: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin per head, each product
// and sum rounded as the torch expression rounds it. half = head_dim / 2 is a multiple of 16 (checked).
template <typename T>
void rotary_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t half,
                 int64_t token_stride, int64_t head_stride) {
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * token_stride + h * head_stride;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 a = load16(x1 + i), b = load16(x2 + i), cv = load16(c + i), sv = load16(s + i);
          const __m512 o1 = _mm512_sub_ps(round_to(x1, _mm512_mul_ps(a, cv)), round_to(x1, _mm512_mul_ps(b, sv)));
          const __m512 o2 = _mm512_add_ps(round_to(x1, _mm512_mul_ps(b, cv)), round_to(x1, _mm512_mul_ps(a, sv)));
          store16(x1 + i, o1);
          store16(x2 + i, o2);
        }
      }
    }
  });
}

// Index of each row's largest value, the first one on ties (as torch.max(dim=-1).indices).
template <typename T>
void argmax_rows(const T* x, int64_t* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i best_at = _mm512_set1_epi32(0);
      __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, _mm512_set1_epi32(16))) {
        const __m512 v = load16(xr + i);
        const __mmask16 higher = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: the earlier one stays
        best = _mm512_mask_mov_ps(best, higher, v);
        best_at = _mm512_mask_mov_epi32(best_at, higher, at);
      }
      alignas(64) float vals[16];
      alignas(64) int32_t idx[16];
      _mm512_store_ps(vals, best);
      _mm512_store_epi32(idx, best_at);
      float top = vals[0];
      int64_t top_at = idx[0];
      for (int l = 1; l < 16; ++l)
        if (vals[l] > top || (vals[l] == top && idx[l] < top_at)) top = vals[l], top_at = idx[l];
      for (; i < n; ++i)
        if (as_float(xr[i]) > top) top = as_float(xr[i]), top_at = i;
      out[r] = top_at;
    }
  });
}

void check_2d(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), name, " must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

// y (a new tensor, or x itself) from x and, when given, the residual updated in place (rms_norm_rows).
void rms_norm_into(const torch::Tensor& x, const torch::Tensor* residual, const torch::Tensor& weight,
                   torch::Tensor& y, double eps) {
  check_2d(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "weight must be [hidden] in x's dtype");
  if (residual) {
    check_2d(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                         weight.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps));
  else
    rms_norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(),
                                residual ? residual->data_ptr<at::BFloat16>() : nullptr,
                                weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), x.size(0), x.size(1),
                                static_cast<float>(eps));
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto y = torch::empty_like(x);
  rms_norm_into(x, nullptr, weight, y, eps);
  return y;
}

// residual <- x + residual; x <- rms_norm(residual) * weight. Both in place.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  rms_norm_into(x, &residual, weight, x, eps);
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_2d(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [rows, 2 * intermediate]");
  const int64_t inter = x.size(1) / 2;
  auto y = torch::empty({x.size(0), inter}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows<float>(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), inter);
  else
    silu_mul_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), x.size(0), inter);
  return y;
}

torch::Tensor argmax(torch::Tensor x) {
  check_2d(x, "x");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "rows must hold 1 to 2^31 - 1 values");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat)
    argmax_rows<float>(x.data_ptr<float>(), out.data_ptr<int64_t>(), x.size(0), x.size(1));
  else
    argmax_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), out.data_ptr<int64_t>(), x.size(0), x.size(1));
  return out;
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(), "x must be [tokens, heads, head_dim], "
              "head_dim contiguous");
  const int64_t half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 32 == 0, "head_dim must be a multiple of 32");
  check_2d(cos, "cos");
  check_2d(sin, "sin");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == half &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be [tokens, head_dim / 2] in x's dtype");
  if (x.scalar_type() == at::kFloat)
    rotary_rows<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.size(1),
                       half, x.stride(0), x.stride(1));
  else
    rotary_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(),
                              sin.data_ptr<at::BFloat16>(), x.size(0), x.size(1), half, x.stride(0), x.stride(1));
}
