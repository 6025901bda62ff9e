// The decoder layers' loop in C++ (decoder_loop.cpp): what it holds, and its one call per step.
#pragma once

#include "ops.h"

#include <vector>

class DecoderLoop {
 public:
  struct Linear {
    torch::Tensor tiles;                // the weight in bf16_tiles.py's tiles
    std::optional<torch::Tensor> bias;  // float32, or none
  };
  struct Layer {
    torch::Tensor input_norm, post_norm;            // RMSNorm weights (bf16)
    Linear qkv, o, gate_up, down;                   // q/k/v and gate/up merged, as the model holds them
    std::optional<torch::Tensor> q_norm, k_norm;    // per-head RMSNorm weights (Qwen3), or none
    torch::Tensor k_cache, v_cache;                 // the layer's KV cache, in kv_layout.py's layout
    int64_t window;                                 // sliding window (0: full attention)
    double k_scale, v_scale;                        // an fp8 cache's scales (1.0 otherwise)
  };

  DecoderLoop(std::vector<Layer> layers, torch::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps, double scale, bool prefetch);

  // x: the step's embeddings [tokens, hidden] bf16 (the residual stream starts as x, updated in place); cos, sin:
  // [tokens, head_dim / 2]; the rest as the CPU attention backend gets them (int64). Returns the final norm's
  // output [tokens, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start);

  // Seconds spent so far in the KV stores and attention kernels of forward's calls (two clock reads a layer):
  // attention's share of a step, measured where the step runs (perf/attention_share.py).
  double attention_seconds() const { return static_cast<double>(attention_ns_) * 1e-9; }

 private:
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  bool prefetch_;
  int64_t attention_ns_ = 0;
};
