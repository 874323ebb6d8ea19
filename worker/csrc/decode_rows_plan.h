// decode_rows' plan (kernels.h's DecodeRowsPlan), shared by the file that checks and
// builds it (decode_rows_plan.cpp) and the one that runs its steps (decode_rows.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"

namespace tandem::decode_rows {

using Bf16 = c10::BFloat16;

inline bool is_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 && t.is_contiguous();
}

// One layer's weights, as raw pointers.
struct LayerWeights {
  const Bf16* norm[kMaxNormsPerLayer];  // by NormSlot
  const Bf16* weight[kLinearsPerLayer];
  const Bf16* bias[kBiasesPerLayer];
  // GGUF and int8 projections' biases: float32, or null
  const at::Tensor* float_bias[kBiasesPerLayer];
};

}  // namespace tandem::decode_rows

// What a model's steps share, checked once: every layer's weights as raw pointers, and the
// tensors behind them held alive.
struct DecodeRowsPlan::State {
  using LayerWeights = tandem::decode_rows::LayerWeights;
  using Bf16 = tandem::decode_rows::Bf16;

  std::vector<at::Tensor> norms, projections, gguf_packed, kv_caches;
  std::vector<at::Tensor> int8_sums, int8_scales;  // per projection where int8
  std::vector<std::optional<at::Tensor>> biases;
  std::vector<int64_t> gguf_types, windows, rope_of_layer;
  std::vector<size_t> first_segment;  // projection p's segments: [first_segment[p], [p + 1])
  std::vector<LayerWeights> weights;
  std::vector<Bf16*> caches;  // each layer's KV cache
  at::Tensor embedding, final_norm;  // [vocab, hidden], [hidden]
  float embed_scale = 0.0f;  // bfloat16-rounded, as the Python path multiplies; 0: none
  int64_t vocab = 0;
  bool gemm = false;  // bf16_gemm_pack's layout, on bf16_gemm; else the GEMV's plain one
  bool gguf_q8 = false;  // GGUF projections with 8-bit activations (gguf_linear_q8)
  bool int8 = false;  // int8_pack's projections (--quantization int8), on int8_linear
  bool gguf = false, gemma_norms = false, qk_norms = false, sandwich_norms = false;
  Activation act = Activation::kSilu;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, block_size = 0, hidden = 0, inter = 0;
  int64_t q_dim = 0, qkv_dim = 0, num_ropes = 0, num_blocks = 0;
  double eps = 0.0, scale = 0.0;
  int64_t shapes[kLinearsPerLayer][2] = {};
};
