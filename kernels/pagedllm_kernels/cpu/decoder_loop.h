// The decoder layers' loop in C++ (decoder_loop.cpp): what it holds, and its one call per step.
#pragma once

#include "ops.h"

#include <atomic>
#include <functional>
#include <vector>

class DecoderLoop {
 public:
  // One of a layer's linears, rows [t, K] -> [t, N] through the kernel its Python module calls on CPU (the
  // factories below); `prefetch` is the bf16 tiles' race setting, which the other kernels do not take.
  struct Linear {
    std::function<torch::Tensor(const torch::Tensor& rows, bool prefetch)> apply;
  };
  // PackedLinear: the weight in bf16_tiles.py's tiles; bias float32 (all four: or none).
  static Linear bf16_tiles(torch::Tensor tiles, std::optional<torch::Tensor> bias);
  // PackedLinear on AMX hosts: the weight in amx_linear.py's tiles; bias float32 or none.
  static Linear amx(torch::Tensor packed, std::optional<torch::Tensor> bias);
  // PackedLinear as a whole: up to `tile_rows` rows through `tiles` (one of the two above, or none), more through
  // oneDNN's matmul on its packed weight (packed_linear.py's pack_weight; bias in the model's dtype, or none).
  static Linear packed(torch::Tensor onednn_weight, std::optional<torch::Tensor> bias, std::optional<Linear> tiles,
                       int64_t tile_rows);
  // Int4Linear (AWQ, GPTQ): int4_layout.py's weight; `perm`: GPTQ desc_act's input order, or none.
  static Linear int4(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group_size,
                     std::optional<torch::Tensor> perm, std::optional<torch::Tensor> bias);
  // Fp8Linear: fp8_linear.py's weight; the input rounded to e4m3 first where the checkpoint's activations are
  // (`round_input`: at `static_scale`, else per token or per tensor).
  static Linear fp8(torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> bias, bool round_input,
                    double static_scale, bool per_token);
  // Int8Linear: W8A8, int8_linear.py's weight.
  static Linear int8(torch::Tensor packed, torch::Tensor scales, torch::Tensor wsum,
                     std::optional<torch::Tensor> bias);
  struct Layer {
    torch::Tensor input_norm, post_norm;            // RMSNorm weights (bf16)
    Linear qkv, o, gate_up, down;                   // q/k/v and gate/up merged, as the model holds them
    std::optional<torch::Tensor> q_norm, k_norm;    // per-head RMSNorm weights (Qwen3), or none
    torch::Tensor k_cache, v_cache;                 // the layer's KV cache, in kv_layout.py's layout
    int64_t window;                                 // sliding window (0: full attention)
    double k_scale, v_scale;                        // an fp8 cache's scales (1.0 otherwise)
  };

  // amx_attention: prompts' attention on the AMX tile unit (paged_attention's `amx`).
  DecoderLoop(std::vector<Layer> layers, torch::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps, double scale, bool prefetch, bool amx_attention);

  // x: the step's embeddings [tokens, hidden] bf16 (the residual stream starts as x, updated in place); cos, sin:
  // [tokens, head_dim / 2]; the rest as the CPU attention backend gets them (int64). Returns the final norm's
  // output [tokens, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start);

  // Seconds spent so far in the KV stores and attention kernels of forward's calls (two clock reads a layer):
  // attention's share of a step, measured where the step runs (perf/attention_share.py).
  double attention_seconds() const { return static_cast<double>(attention_ns_) * 1e-9; }
  // Seconds spent so far in the layers' linears (four a layer, their kernels' calls as a whole): with attention's,
  // what of a step is neither (norms, rotary, activation, the loop's own overhead).
  double linear_seconds() const { return static_cast<double>(linear_ns_) * 1e-9; }

 private:
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  bool prefetch_, amx_attention_;
  std::atomic<int64_t> attention_ns_{0}, linear_ns_{0};  // forward runs without the GIL: Python may read them
};
