// The C++ entry points of the CPU kernels, declared once. Each .cpp that defines one includes this header, so a
// definition that drifts from its declaration fails to compile; bindings.cpp exposes them to Python.
#pragma once

#include <torch/extension.h>

#include <optional>

// paged_attention.cpp: each row's last tokens (one for a decode, a prompt or its chunk) over the row's context,
// causal. An fp8 cache's values are its elements times k_scale / v_scale (1.0 for other caches); amx: prompts on
// the AMX tile unit where it applies.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start, double scale, int64_t window,
                              double k_scale, double v_scale, bool amx);
// kv_store.cpp: into an fp8 cache, k / k_scale and v / v_scale, rounded to e4m3 and clamped to +-448.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
              double k_scale, double v_scale);
// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor argmax(torch::Tensor x);
// token_mask.cpp
void mask_logits_(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);
// lora.cpp
void lora_delta_(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor tokens,
                 torch::Tensor group_start, torch::Tensor group_slot, torch::Tensor slot_rank,
                 torch::Tensor slice_offsets, int64_t max_rank);
// quantized_linear.cpp: int4 weights in int4_layout.py's layout, fp8 ones in fp8_linear.py's; bias float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                          int64_t group_size, std::optional<torch::Tensor> bias);
void int4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group_size,
                     torch::Tensor out);
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                         std::optional<torch::Tensor> bias);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                          bool prefetch);
torch::Tensor fp8_round_input(torch::Tensor x, double static_scale, bool per_token);
// int8_linear.cpp: W8A8, x quantized per row inside; weights in int8_linear.py's layout.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor wsum,
                          std::optional<torch::Tensor> bias);
// decoder_loop.cpp: packed_linear.py's bucket_rows, the rows oneDNN's matmul is given for `rows`.
int64_t onednn_rows(int64_t rows);
// amx_linear.cpp
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias);
