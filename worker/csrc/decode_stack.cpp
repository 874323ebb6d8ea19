// A decode step through every layer of a llama-shaped model, in one call.
//
// A SmolLM2 step runs ~300 small kernels; driving them from Python costs ~6 ms a step
// whatever the batch (a fifth of a batch-1 step, bench/step_profile). This runs the
// kernels DecoderLayer.forward calls on NativeOps over PackedLinear projections, in the
// same order with the same arguments, so its results are bit-identical to that path
// (tests/unit/test_decode_stack.py): only the interpreter is gone.
//
// Layer l (RMSNorm, fused q/k/v with optional bias, RoPE, paged attention, o projection
// with optional bias, residual add + RMSNorm, fused gate/up, SiLU-and-multiply, down
// projection, residual add) reads norms[2 l + i] (input, post-attention), plain[4 l + i]
// and packed[4 l + i] (qkv, o, gate_up, down: the plain weight where the GEMV takes
// a few rows, else none; the packed one: oneDNN's, or bf16_gemm's where
// packings[4 l + i] is kBf16GemmPacking), biases[2 l + i] (qkv's, o's). With
// --quantization gguf a projection is a QuantLinear instead: gguf_types[4 l + i] is its
// ggml type (-1 for a PackedLinear), plain[4 l + i] its blocks, packed[4 l + i] its quants
// as gguf_gemm_pack repacked them (empty where it has none).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {


// oneDNN's prepacked linear: the op PackedLinear.forward calls past the GEMV's rows.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// PackedLinear.forward: the GEMV's rows where the plain weight is kept, else the kernel
// of the packed weight's layout.
at::Tensor linear(const at::Tensor& x, const std::optional<at::Tensor>& plain,
                  const at::Tensor& packed, int64_t packing, const std::optional<at::Tensor>& bias) {
  if (plain.has_value() && x.size(0) <= bf16_gemv_max_rows(plain->size(0), plain->size(1)))
    return bf16_gemv(x, *plain, bias);
  if (packing == kBf16GemmPacking) return bf16_gemm(x, packed, bias);
  return onednn_linear(x, packed, bias);
}

// QuantLinear.forward (one segment of blocks, and its quants repacked for many bfloat16
// rows where gemm holds any): up to fused_max_rows rows (bfloat16 as they are, else
// float32) on the fused dequantize-and-dot kernels, else a dense matmul over the weight
// dequantized.
at::Tensor gguf_projection(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& gemm,
                           int64_t type, const std::optional<at::Tensor>& bias,
                           int64_t fused_max_rows, bool q8) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (x.size(0) <= fused_max_rows) {
    const at::Tensor rows = bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();
    // bfloat16 rows: the product rounded once in the kernel, as .to() would round it
    return gguf_linear(rows, blocks, type, bias, gemm, bf16, q8).to(x.scalar_type());
  }
  const at::Tensor weight = gguf_dequantize(blocks, type, x.size(1), bf16).to(x.scalar_type());
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(x.scalar_type());
  return at::linear(x, weight, b);
}

struct Projections {
  const std::optional<at::Tensor>* plain;
  const at::Tensor* packed;
  const int64_t* packings;
  const int64_t* gguf_types;
  int64_t gguf_fused_max_rows;
  bool gguf_q8;

  at::Tensor operator()(size_t i, const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    if (gguf_types[i] >= 0)
      return gguf_projection(x, *plain[i], packed[i], gguf_types[i], bias, gguf_fused_max_rows,
                             gguf_q8);
    return linear(x, plain[i], packed[i], packings[i], bias);
  }
};

}  // namespace

// x [n, hidden] (the embeddings) -> the last layer's output [n, hidden], before the
// final norm. kv_caches[l], windows[l] (0: full attention): layer l's cache and window.
at::Tensor decode_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& norms,
                         const std::vector<std::optional<at::Tensor>>& plain,
                         const std::vector<at::Tensor>& packed,
                         const std::vector<int64_t>& packings,
                         const std::vector<std::optional<at::Tensor>>& biases,
                         const std::vector<int64_t>& gguf_types, int64_t gguf_fused_max_rows,
                         bool gguf_q8,
                         std::vector<at::Tensor> kv_caches, const std::vector<int64_t>& windows,
                         const at::Tensor& slots, const at::Tensor& block_table,
                         const at::Tensor& context_lens, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, double eps, double scale) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(norms.size() == layers * kNormsPerLayer &&
                  plain.size() == layers * kLinearsPerLayer &&
                  packed.size() == layers * kLinearsPerLayer &&
                  packings.size() == layers * kLinearsPerLayer &&
                  gguf_types.size() == layers * kLinearsPerLayer &&
                  biases.size() == layers * kBiasesPerLayer && windows.size() == layers,
              "decode_layers: per layer ", kNormsPerLayer, " norms, ", kLinearsPerLayer,
              " plain and packed weights, ", kBiasesPerLayer, " biases, a cache and a window");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == slots.size(0) && x_in.size(0) > 0,
              "x must be [n, hidden], a row per slot");
  const int64_t n = x_in.size(0);
  at::Tensor x = x_in;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* norm = &norms[l * kNormsPerLayer];
    const size_t first = l * kLinearsPerLayer;
    const Projections proj{&plain[first], &packed[first], &packings[first], &gguf_types[first],
                           gguf_fused_max_rows, gguf_q8};
    const std::optional<at::Tensor>* b = &biases[l * kBiasesPerLayer];
    // Attention.forward
    at::Tensor qkv = proj(0, rms_norm(x, norm[0], eps, false), b[0])
                         .view({n, heads + 2 * kv_heads, head_dim});
    at::Tensor qk = qkv.narrow(1, 0, heads + kv_heads);
    rotary_(qk, cos, sin, heads + kv_heads);
    at::Tensor k = qkv.narrow(1, heads, kv_heads);
    at::Tensor v = qkv.narrow(1, heads + kv_heads, kv_heads);
    write_kv(kv_caches[l], slots, k, v);  // paged_attention, every token a decode
    at::Tensor attn = decode_attention(qkv.narrow(1, 0, heads).contiguous(), kv_caches[l],
                                       block_table, context_lens, scale, windows[l], block_size);
    at::Tensor o = proj(1, attn.reshape({n, heads * head_dim}), b[1]);
    // DecoderLayer.forward: x, h = add_and_norm(x, attn); x + mlp(h)
    auto [residual, h] = add_rms_norm(x, o, norm[1], eps, false);
    at::Tensor act = act_mul(proj(2, h, std::nullopt), static_cast<int64_t>(Activation::kSilu));
    x = at::add(residual, proj(3, act, std::nullopt));
  }
  return x;
}
