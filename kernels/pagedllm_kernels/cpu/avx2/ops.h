// The entry points of the AVX2 kernels, declared once (each .cpp that defines one includes this header, so a
// definition that drifts from its declaration fails to compile); bindings.cpp exposes them to Python.
#pragma once

#include <torch/extension.h>

#include <optional>

// bf16_linear.cpp: x @ W^T + b, W in avx2_linear.py's tiles [N/8, K, 8], bias float32.
torch::Tensor avx2_bf16_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias);
// int4_linear.cpp: x @ W^T + b, W in int4_layout.py's packing; and W written as bf16_linear's tiles into out.
torch::Tensor avx2_int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                               int64_t group_size, std::optional<torch::Tensor> bias);
void avx2_int4_dequantize_tiles(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group_size,
                                torch::Tensor out);
// fp8_linear.cpp: x @ W^T + b, W e4m3 in fp8_layout.py's arrangement with one scale per column; and W written
// as bf16_linear's tiles into out.
torch::Tensor avx2_fp8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              std::optional<torch::Tensor> bias);
void avx2_fp8_dequantize_tiles(torch::Tensor packed, torch::Tensor scales, torch::Tensor out);
// fp8_linear.cpp: x rounded to e4m3 and back (an fp8 checkpoint's activations) at static_scale when > 0, else
// at max |x| / 448 over each row (per_token) or over all of x.
torch::Tensor avx2_fp8_round_input(torch::Tensor x, double static_scale, bool per_token);
// decode_attention.cpp: one query token per row over its context (seq_lens), through the block tables, in the
// torch backend's cache layout (q's dtype, or e4m3 with per-tensor k_scale and v_scale); window > 0 keeps only
// the last `window` positions.
torch::Tensor avx2_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                    int64_t window, double k_scale, double v_scale);
// kv_store.cpp: k / k_scale and v / v_scale as e4m3 codes into their slots of an fp8 cache (the torch backend's
// layout); slot -1 skipped.
void avx2_store_kv_fp8(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slots, double k_scale, double v_scale);
