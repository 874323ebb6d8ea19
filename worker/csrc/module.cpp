// The Python module of Tandem's native CPU kernels (loaded by worker/native.py).
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& context_lens,
                            double scale, int64_t window, int64_t block_size);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& add,
                                                const at::Tensor& weight, double eps, bool gemma);
void write_kv(at::Tensor& kv_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& mask);
bool has_bf16_gemv();
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias);
at::Tensor decode_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& norms,
                         const std::vector<std::optional<at::Tensor>>& plain,
                         const std::vector<at::Tensor>& packed,
                         const std::vector<std::optional<at::Tensor>>& biases,
                         std::vector<at::Tensor> kv_caches, const std::vector<int64_t>& windows,
                         const at::Tensor& slots, const at::Tensor& block_table,
                         const at::Tensor& context_lens, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, double eps, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention");
  m.def("rms_norm", &rms_norm, "RMSNorm rows (llama or gemma style)");
  m.def("write_kv", &write_kv, "write a step's K and V rows into their cache slots");
  m.def("rotary_", &rotary_, "rotary embedding in place on the first heads");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up projection");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm; returns (sum, normed)");
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "structured outputs: -inf where a token's mask bit is clear, in place");
  m.def("has_bf16_gemv", &has_bf16_gemv, "whether bf16_gemv was built (AVX512-BF16)");
  m.def("bf16_gemv", &bf16_gemv, "x W^T + b for 1-4 bfloat16 rows, streaming W",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("decode_layers", &decode_layers,
        "a decode step through every layer of a llama-shaped model");
}
