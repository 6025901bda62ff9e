// The entry points of the AVX2 kernels, declared once (each .cpp that defines one includes this header, so a
// definition that drifts from its declaration fails to compile); bindings.cpp exposes them to Python.
#pragma once

#include <torch/extension.h>

#include <optional>

// bf16_linear.cpp: x @ W^T + b, W in avx2_linear.py's tiles [N/8, K, 8], bias float32.
torch::Tensor avx2_bf16_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias);
// decode_attention.cpp: one query token per row over its context (seq_lens), through the block tables, in the
// torch backend's cache layout; window > 0 keeps only the last `window` positions.
torch::Tensor avx2_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                    int64_t window);
