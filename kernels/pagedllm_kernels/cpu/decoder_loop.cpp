// The Llama-family decoder's layers run in one C++ call: the same kernels, in the same order and with the same
// arguments as the Python modules (models/llama.py with the fused ops, the linears' CPU kernels and the CPU
// attention backend) call them one by one, so the result is bit-identical; what goes is the Python between the
// kernels and each call's crossing into the extension (~70 us a layer on the 2-core hosts). Built once per engine
// (backend/pagedllm/models/decoder_loop.py decides where it applies), it holds the weights (bf16 or AMX tiles or a
// quantized format's, each linear through the kernel its module calls) and the KV caches;
// each call gets the step's embeddings, rope tables and attention metadata.
#include "decoder_loop.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <chrono>

// packed_linear.py's bucket_rows: the row count oneDNN is given (zero rows appended), so its primitive caches hold
// a few dozen sizes; tests/models/test_decoder_loop.py holds the two equal.
int64_t onednn_rows(int64_t rows) {
  if (rows <= 8) {
    int64_t bucket = 1;
    while (bucket < rows) bucket <<= 1;
    return bucket;
  }
  const int64_t step = rows <= 64 ? 8 : rows <= 512 ? 16 : 64;
  return (rows + step - 1) / step * step;
}

namespace {

// packed_linear.py's packed_matmul: the rows padded to their bucket through the op PackedLinear calls, the padding
// dropped. Called boxed: the op is registered by torch, its C++ signature is not in its headers.
torch::Tensor onednn_matmul(const torch::Tensor& x, const torch::Tensor& weight,
                            const std::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), bucket = onednn_rows(rows);
  torch::Tensor padded = x;
  if (bucket != rows) {
    padded = x.new_zeros({bucket, x.size(1)});
    padded.narrow(0, 0, rows).copy_(x);
  }
  torch::jit::Stack stack{padded, weight, bias ? c10::IValue(*bias) : c10::IValue(), "none",
                          c10::List<std::optional<c10::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor().narrow(0, 0, rows);
}

// f() with its wall time added to `ns`: two clock reads (~50 ns) beside calls of tens of microseconds or more.
template <class F>
torch::Tensor clocked(std::atomic<int64_t>& ns, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  torch::Tensor out = f();
  ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

DecoderLoop::Linear DecoderLoop::bf16_tiles(torch::Tensor tiles, std::optional<torch::Tensor> bias) {
  return {[tiles, bias](const torch::Tensor& x, bool prefetch) { return bf16_linear(x, tiles, bias, prefetch); }};
}

DecoderLoop::Linear DecoderLoop::amx(torch::Tensor packed, std::optional<torch::Tensor> bias) {
  return {[packed, bias](const torch::Tensor& x, bool) { return amx_linear(x, packed, bias); }};
}

DecoderLoop::Linear DecoderLoop::packed(torch::Tensor onednn_weight, std::optional<torch::Tensor> bias,
                                        std::optional<Linear> tiles, int64_t tile_rows) {
  return {[=](const torch::Tensor& x, bool prefetch) {
    return tiles && x.size(0) <= tile_rows ? tiles->apply(x, prefetch) : onednn_matmul(x, onednn_weight, bias);
  }};
}

DecoderLoop::Linear DecoderLoop::int4(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                                      int64_t group_size, std::optional<torch::Tensor> perm,
                                      std::optional<torch::Tensor> bias) {
  return {[=](const torch::Tensor& x, bool) {
    return int4_linear(perm ? x.index_select(1, *perm) : x, packed, scales, mins, group_size, bias);
  }};
}

DecoderLoop::Linear DecoderLoop::fp8(torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> bias,
                                     bool round_input, double static_scale, bool per_token) {
  return {[=](const torch::Tensor& x, bool) {
    return fp8_linear(round_input ? fp8_round_input(x, static_scale, per_token) : x, packed, scales, bias);
  }};
}

DecoderLoop::Linear DecoderLoop::int8(torch::Tensor packed, torch::Tensor scales, torch::Tensor wsum,
                                      std::optional<torch::Tensor> bias) {
  return {[=](const torch::Tensor& x, bool) { return int8_linear(x, packed, scales, wsum, bias); }};
}

DecoderLoop::DecoderLoop(std::vector<Layer> layers, torch::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double scale, bool prefetch, bool amx_attention)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), heads_(num_heads), kv_heads_(num_kv_heads),
      head_dim_(head_dim), eps_(eps), scale_(scale), prefetch_(prefetch), amx_attention_(amx_attention) {
  TORCH_CHECK(!layers_.empty(), "a decoder of at least one layer");
  TORCH_CHECK(head_dim_ % 32 == 0, "head_dim must be a multiple of 32 (the fused rotary)");
  for (const Layer& layer : layers_)
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "q_norm and k_norm come together or not at all");
}

torch::Tensor DecoderLoop::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be contiguous bfloat16 [tokens, hidden]");
  const int64_t t = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  torch::Tensor residual = x;  // the residual stream; `h` is the last block's output, not yet added to it
  torch::Tensor h = rms_norm(x, layers_[0].input_norm, eps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    if (i > 0) add_rms_norm_(h, residual, layer.input_norm, eps_);
    // Attention: q, k, v are views of the projection's rows, as the Python's split + reshape leaves them.
    const torch::Tensor qkv = clocked(linear_ns_, [&] { return layer.qkv.apply(h, prefetch_); });
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads_, head_dim_});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads_, head_dim_});
    if (layer.q_norm) {  // Qwen3: per-head RMSNorm before rotary (RMSNorm's fused path copies the heads out)
      q = rms_norm(q.reshape({-1, head_dim_}).contiguous(), *layer.q_norm, eps_).view({t, heads_, head_dim_});
      k = rms_norm(k.reshape({-1, head_dim_}).contiguous(), *layer.k_norm, eps_).view({t, kv_heads_, head_dim_});
    }
    rotary_(q, cos, sin);
    rotary_(k, cos, sin);
    const torch::Tensor o = clocked(attention_ns_, [&] {
      store_kv(k, v, layer.k_cache, layer.v_cache, slots, layer.k_scale, layer.v_scale);
      return paged_attention(q, layer.k_cache, layer.v_cache, block_tables, seq_lens, query_start, scale_,
                             layer.window, layer.k_scale, layer.v_scale, amx_attention_);
    });
    h = clocked(linear_ns_, [&] { return layer.o.apply(o.view({t, q_size}), prefetch_); });
    // Feed-forward: SiLU-and-mul between the merged gate/up projection and the down projection.
    add_rms_norm_(h, residual, layer.post_norm, eps_);
    const torch::Tensor gate_up = clocked(linear_ns_, [&] { return layer.gate_up.apply(h, prefetch_); });
    const torch::Tensor act = silu_and_mul(gate_up);
    h = clocked(linear_ns_, [&] { return layer.down.apply(act, prefetch_); });
  }
  add_rms_norm_(h, residual, final_norm_, eps_);
  return h;
}
