// A decode step of 1-4 rows through every layer of a llama-shaped model, in one call.
//
// At batch 1 a SmolLM2 step runs ~300 small kernels; driving them from Python costs
// ~5 ms a step (a fifth of it, bench/step_profile), more than the attention. This runs
// the same kernels in the same order with the same roundings as DecoderLayer.forward on
// NativeOps with the GEMV (worker/models/decoder.py), so its results are bit-identical
// to that path (tests/unit/test_decode_stack.py): only the interpreter is gone.
//
// Layer l of a llama-shaped model (RMSNorm, fused q/k/v with optional bias, RoPE, paged
// attention, o projection with optional bias, residual add + RMSNorm, fused gate/up,
// SiLU-and-multiply, down projection, residual add) reads weights[6 l .. 6 l + 5]:
// input norm, qkv, o, post-attention norm, gate_up, down; biases[2 l], biases[2 l + 1]:
// qkv's and o's.
#include <ATen/ATen.h>

#include <cstdint>
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
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias);

namespace {
constexpr size_t kWeightsPerLayer = 6;
constexpr size_t kBiasesPerLayer = 2;
}  // namespace

// x [n, hidden] (the embeddings) -> the last layer's output [n, hidden], before the
// final norm. kv_caches[l], windows[l] (0: full attention): layer l's cache and window.
at::Tensor decode_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& weights,
                         const std::vector<std::optional<at::Tensor>>& biases,
                         std::vector<at::Tensor> kv_caches, const std::vector<int64_t>& windows,
                         const at::Tensor& slots, const at::Tensor& block_table,
                         const at::Tensor& context_lens, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, double eps, double scale) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(weights.size() == layers * kWeightsPerLayer &&
                  biases.size() == layers * kBiasesPerLayer && windows.size() == layers,
              "decode_layers: ", kWeightsPerLayer, " weights, ", kBiasesPerLayer,
              " biases, one cache and one window per layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == slots.size(0), "x must be [n, hidden]");
  const int64_t n = x_in.size(0);
  at::Tensor x = x_in;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kWeightsPerLayer];
    const std::optional<at::Tensor>* b = &biases[l * kBiasesPerLayer];
    // Attention.forward
    at::Tensor qkv = bf16_gemv(rms_norm(x, w[0], eps, false), w[1], b[0])
                         .view({n, heads + 2 * kv_heads, head_dim});
    at::Tensor qk = qkv.narrow(1, 0, heads + kv_heads);
    rotary_(qk, cos, sin, heads + kv_heads);
    at::Tensor k = qkv.narrow(1, heads, kv_heads);
    at::Tensor v = qkv.narrow(1, heads + kv_heads, kv_heads);
    write_kv(kv_caches[l], slots, k, v);  // paged_attention, every token a decode
    at::Tensor attn = decode_attention(qkv.narrow(1, 0, heads).contiguous(), kv_caches[l],
                                       block_table, context_lens, scale, windows[l], block_size);
    at::Tensor o = bf16_gemv(attn.reshape({n, heads * head_dim}), w[2], b[1]);
    // DecoderLayer.forward: x, h = add_and_norm(x, attn); x + mlp(h)
    auto [residual, h] = add_rms_norm(x, o, w[3], eps, false);
    at::Tensor down = bf16_gemv(silu_mul(bf16_gemv(h, w[4], std::nullopt)), w[5], std::nullopt);
    x = at::add(residual, down);
  }
  return x;
}
