// The Python module of the CPU kernels (one extension, built from every .cpp in this directory).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window);
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor argmax(torch::Tensor x);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias);
void amx_unpack_weight(torch::Tensor packed, torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (AVX-512, fp32 math)");
  m.def("store_kv", &store_kv, "write K/V into their cache slots in the kernels' block layout");
  m.def("rms_norm", &rms_norm, "RMSNorm, fp32 statistics");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x, then x = RMSNorm(residual), in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("rotary_", &rotary_, "rotary embedding in place (rotate-half layout)");
  m.def("amx_linear", &amx_linear, "bf16 x @ W^T + b with AMX tiles, W packed by amx_linear.pack_weight");
  m.def("amx_unpack_weight", &amx_unpack_weight, "the plain [N, K] weight back from amx_linear's packing");
  m.def("argmax", &argmax, "index of each row's largest value, the first on ties");
}
