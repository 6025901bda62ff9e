// The Python module of the CPU kernels (one extension, built from every .cpp in this directory).
#include "decoder_loop.h"
#include "ops.h"

// The long kernels (a linear, attention over a step's rows) run without the GIL, so the stub's other threads
// (taking in requests, sending responses) are not held up to Python's 5 ms switch interval behind them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto kFree = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, kFree, "paged attention over each row's context, its last tokens causal (AVX-512 or AMX, fp32 sums)");
  m.def("store_kv", &store_kv, "write K/V into their cache slots in the kernels' block layout");
  m.def("rms_norm", &rms_norm, "RMSNorm, fp32 statistics");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x, then x = RMSNorm(residual), in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("rotary_", &rotary_, "rotary embedding in place (rotate-half layout)");
  m.def("amx_linear", &amx_linear, kFree, "bf16 x @ W^T + b with AMX tiles, W packed by amx_linear.pack");
  m.def("int4_linear", &int4_linear, kFree, "bf16 x @ W^T + b, W int4 (int4_layout.py) dequantized in the matmul");
  m.def("int4_dequantize", &int4_dequantize, "the bf16 [N, K] weight of an int4_layout.py weight");
  m.def("fp8_linear", &fp8_linear, kFree, "bf16 x @ W^T * s + b, W e4m3 (fp8_linear.py) widened in the matmul");
  m.def("bf16_linear", &bf16_linear, kFree, "bf16 x @ W^T + b, W in bf16_tiles.py's tiles (decode-sized batches)");
  m.def("int8_linear", &int8_linear, kFree, "W8A8: x quantized per row, int8 W per column, AVX512-VNNI int32 sums");
  m.def("fp8_round_input", &fp8_round_input, "x rounded to e4m3 at a static, per-row or per-tensor scale, and back");
  m.def("onednn_rows", &onednn_rows, "the rows the decoder loop gives oneDNN's matmul for `rows` (bucket_rows)");
  m.def("argmax", &argmax, "index of each row's largest value, the first on ties");
  m.def("lora_delta_", &lora_delta_, kFree, "y += (x A[slot]^T) B[slot] per adapter group of tokens, bf16, in place");
  m.def("mask_logits_", &mask_logits_, "-inf, in place, at the tokens a row's bitmask does not allow");
  pybind11::class_<DecoderLoop::Linear>(m, "LoopLinear")
      .def_static("bf16_tiles", &DecoderLoop::bf16_tiles, pybind11::arg("tiles"), pybind11::arg("bias"))
      .def_static("amx", &DecoderLoop::amx, pybind11::arg("packed"), pybind11::arg("bias"))
      .def_static("packed", &DecoderLoop::packed, pybind11::arg("onednn_weight"), pybind11::arg("bias"),
                  pybind11::arg("tiles"), pybind11::arg("tile_rows"))
      .def_static("int4", &DecoderLoop::int4, pybind11::arg("packed"), pybind11::arg("scales"), pybind11::arg("mins"),
                  pybind11::arg("group_size"), pybind11::arg("perm"), pybind11::arg("bias"))
      .def_static("fp8", &DecoderLoop::fp8, pybind11::arg("packed"), pybind11::arg("scales"), pybind11::arg("bias"),
                  pybind11::arg("round_input"), pybind11::arg("static_scale"), pybind11::arg("per_token"))
      .def_static("int8", &DecoderLoop::int8, pybind11::arg("packed"), pybind11::arg("scales"),
                  pybind11::arg("wsum"), pybind11::arg("bias"));
  pybind11::class_<DecoderLoop::Layer>(m, "LoopLayer")
      .def(pybind11::init([](torch::Tensor input_norm, torch::Tensor post_norm, DecoderLoop::Linear qkv,
                             DecoderLoop::Linear o, DecoderLoop::Linear gate_up, DecoderLoop::Linear down,
                             std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                             torch::Tensor k_cache, torch::Tensor v_cache, int64_t window, double k_scale,
                             double v_scale) {
             return DecoderLoop::Layer{input_norm, post_norm, qkv, o, gate_up, down, q_norm, k_norm,
                                       k_cache, v_cache, window, k_scale, v_scale};
           }),
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("qkv"), pybind11::arg("o"),
           pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("q_norm"), pybind11::arg("k_norm"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("window"), pybind11::arg("k_scale"),
           pybind11::arg("v_scale"));
  pybind11::class_<DecoderLoop>(m, "DecoderLoop")
      .def(pybind11::init<std::vector<DecoderLoop::Layer>, torch::Tensor, int64_t, int64_t, int64_t, double, double,
                          bool, bool>(),
           pybind11::arg("layers"), pybind11::arg("final_norm"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("prefetch"), pybind11::arg("amx_attention"))
      .def("forward", &DecoderLoop::forward, kFree, "a step through every layer and the final norm (decoder_loop.cpp)")
      .def_property_readonly("attention_seconds", &DecoderLoop::attention_seconds,
                             "seconds spent in forward's KV stores and attention kernels so far")
      .def_property_readonly("linear_seconds", &DecoderLoop::linear_seconds,
                             "seconds spent in forward's layers' linears so far");
}
