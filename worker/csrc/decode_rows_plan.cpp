// DecodeRowsPlan's constructor: decode_rows' checks of a model's weights, norms, biases
// and caches, made once (kernels.h), and the raw pointers its steps read.
#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "decode_rows_plan.h"
#include "kernels.h"

using tandem::decode_rows::Bf16;
using tandem::decode_rows::is_bf16;
using tandem::decode_rows::LayerWeights;

DecodeRowsPlan::DecodeRowsPlan(
    std::vector<at::Tensor> norms, std::vector<at::Tensor> projections, bool gemm,
    std::vector<std::optional<at::Tensor>> biases, std::vector<int64_t> gguf_types,
    std::vector<at::Tensor> gguf_packed, const std::vector<int64_t>& gguf_segments,
    bool gguf_q8, std::vector<at::Tensor> int8_sums, std::vector<at::Tensor> int8_scales,
    bool gemma_norms, bool qk_norms, bool sandwich_norms, int64_t activation,
    std::vector<at::Tensor> kv_caches, std::vector<int64_t> windows,
    std::vector<int64_t> rope_of_layer, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, double eps, double scale, at::Tensor embedding, double embed_scale,
    at::Tensor final_norm) {
  auto state = std::make_shared<State>();
  State& st = *state;
  st.norms = std::move(norms);
  st.projections = std::move(projections);
  st.biases = std::move(biases);
  st.gguf_types = std::move(gguf_types);
  st.gguf_packed = std::move(gguf_packed);
  st.int8_sums = std::move(int8_sums);
  st.int8_scales = std::move(int8_scales);
  st.kv_caches = std::move(kv_caches);
  st.windows = std::move(windows);
  st.rope_of_layer = std::move(rope_of_layer);
  st.gemm = gemm;
  st.gguf_q8 = gguf_q8;
  st.gemma_norms = gemma_norms, st.qk_norms = qk_norms, st.sandwich_norms = sandwich_norms;
  st.heads = heads, st.kv_heads = kv_heads, st.head_dim = head_dim, st.block_size = block_size;
  st.eps = eps, st.scale = scale;
  const auto& norms_ = st.norms;
  const auto& projections_ = st.projections;
  const auto& kv_caches_ = st.kv_caches;
  const size_t layers = kv_caches_.size();
  const size_t norms_per_layer = decode_rows_norms_per_layer(qk_norms, sandwich_norms);
  st.act = activation_of(activation);
  const bool gguf = st.gguf = !st.gguf_types.empty();
  // int8 projections: projections[p] int8_pack's weight, int8_sums[p] and int8_scales[p]
  // its row sums and scales.
  const bool int8 = st.int8 = !st.int8_scales.empty();
  TORCH_CHECK(!int8 || (!gguf && !gemm && st.int8_sums.size() == layers * kLinearsPerLayer &&
                        st.int8_scales.size() == layers * kLinearsPerLayer),
              "decode_rows: int8 projections take row sums and scales each, not GGUF nor the GEMM");
  TORCH_CHECK(layers > 0 && norms_.size() == layers * norms_per_layer &&
                  (gguf || projections_.size() == layers * kLinearsPerLayer) &&
                  st.biases.size() == layers * kBiasesPerLayer && st.windows.size() == layers &&
                  st.rope_of_layer.size() == layers,
              "decode_rows: per layer ", norms_per_layer, " norms, ", kLinearsPerLayer,
              " weights, ", kBiasesPerLayer, " biases, a cache, a window and its RoPE");
  for (const int64_t rope : st.rope_of_layer) {
    TORCH_CHECK(rope >= 0, "decode_rows: a layer's RoPE is an index into the step's cos and sin");
    st.num_ropes = std::max(st.num_ropes, rope + 1);
  }
  // GGUF projections: projection p is gguf_segments[p] segments, the next ones in order;
  // segment s is projections[s]'s blocks of ggml type gguf_types[s], repacked as
  // gguf_packed[s]. The caller keeps n within what they all fuse.
  TORCH_CHECK(!gguf || (!gemm && st.gguf_types.size() == projections_.size() &&
                        st.gguf_packed.size() == projections_.size() &&
                        gguf_segments.size() == layers * kLinearsPerLayer),
              "decode_rows: GGUF projections take a type and a repacked weight each segment, "
              "a segment count each projection, not the GEMM");
  std::vector<size_t>& first_segment = st.first_segment;
  first_segment.push_back(0);
  for (const int64_t count : gguf_segments) {
    TORCH_CHECK(count >= 1, "decode_rows: a GGUF projection has at least one segment");
    first_segment.push_back(first_segment.back() + static_cast<size_t>(count));
  }
  TORCH_CHECK(!gguf || first_segment.back() == projections_.size(),
              "decode_rows: the GGUF segment counts add up to ", first_segment.back(),
              ", not the ", projections_.size(), " segments given");
  // Projection p's outputs (its segments' together).
  const auto outputs = [&](size_t p) {
    if (int8) return st.int8_scales[p].size(0);
    if (!gguf) return projections_[p].size(0);
    int64_t total = 0;
    for (size_t s = first_segment[p]; s < first_segment[p + 1]; ++s)
      total += projections_[s].size(0);
    return total;
  };
  TORCH_CHECK(!gemm || has_bf16_gemm(), "decode_rows: this build has no bf16_gemm");
  // The raw-row kernels are built for AVX512-BF16 hosts, where the GEMV is (int8_linear
  // runs on any).
  TORCH_CHECK(gemm || int8 || has_bf16_gemv(), "decode_rows: this build has no GEMV");
  TORCH_CHECK(is_bf16(norms_[0]) && norms_[0].dim() == 1,
              "decode_rows: a norm's weight must be contiguous bfloat16 [hidden]");
  const int64_t hidden = st.hidden = norms_[0].size(0);
  const int64_t q_dim = st.q_dim = heads * head_dim;
  const int64_t qkv_dim = st.qkv_dim = (heads + 2 * kv_heads) * head_dim;
  const int64_t inter = st.inter = outputs(2) / 2;
  const int64_t shapes[kLinearsPerLayer][2] = {
      {qkv_dim, hidden}, {hidden, q_dim}, {2 * inter, hidden}, {hidden, inter}};
  std::copy(&shapes[0][0], &shapes[0][0] + 2 * kLinearsPerLayer, &st.shapes[0][0]);
  // The GEMM reads x in bfloat16 pairs: every projection's input must hold whole pairs.
  TORCH_CHECK(!gemm || (hidden % 2 == 0 && q_dim % 2 == 0 && inter % 2 == 0),
              "decode_rows: the GEMM takes even input widths only");
  std::vector<LayerWeights>& weights = st.weights;
  weights.resize(layers);
  for (size_t l = 0; l < layers; ++l) {
    for (size_t i = 0; i < kLinearsPerLayer; ++i) {
      const size_t p = l * kLinearsPerLayer + i;
      const int64_t out = shapes[i][0], in = shapes[i][1];
      if (gguf) {  // gguf_linear checks the blocks' width against `in` on every call
        for (size_t s = first_segment[p]; s < first_segment[p + 1]; ++s) {
          const at::Tensor& w = projections_[s];
          TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                      "decode_rows: layer ", l, " GGUF weight ", i,
                      " must be contiguous uint8 [outputs, row bytes] segments");
        }
        TORCH_CHECK(outputs(p) == out, "decode_rows: layer ", l, " GGUF weight ", i, " has ",
                    outputs(p), " outputs, not ", out);
        continue;
      }
      if (int8) {
        TORCH_CHECK(int8_holds(projections_[p], st.int8_sums[p], st.int8_scales[p], out, in),
                    "decode_rows: layer ", l, " int8 weight ", i, " must be int8_pack's [", out,
                    ", ", in, "] with int32 row sums and float32 scales [", out, "]");
        continue;
      }
      const at::Tensor& w = projections_[p];
      TORCH_CHECK(gemm ? bf16_gemm_holds(w, out, in)
                       : is_bf16(w) && w.dim() == 2 && w.size(0) == out && w.size(1) == in,
                  "decode_rows: layer ", l, " weight ", i, " must be contiguous bfloat16 [", out,
                  ", ", in, "]", gemm ? ", packed by bf16_gemm_pack" : "");
      weights[l].weight[i] = w.data_ptr<Bf16>();
    }
    for (size_t i = 0; i < kBiasesPerLayer; ++i) {
      const auto& b = st.biases[l * kBiasesPerLayer + i];
      // QuantLinear and Int8Linear keep their biases in float32 (their kernels add them to
      // the float32 product).
      const bool float_bias = gguf || int8;
      const at::ScalarType dtype = float_bias ? at::kFloat : at::kBFloat16;
      TORCH_CHECK(!b || (b->scalar_type() == dtype && b->is_contiguous() &&
                         b->numel() == shapes[i][0]),
                  "decode_rows: a bias must be contiguous [out], in float32 for GGUF and int8 "
                  "projections, else in bfloat16");
      weights[l].bias[i] = b && !float_bias ? b->data_ptr<Bf16>() : nullptr;
      weights[l].float_bias[i] = b && float_bias ? &*b : nullptr;
    }
    for (size_t i = 0; i < norms_per_layer; ++i) {
      const at::Tensor& norm = norms_[l * norms_per_layer + i];
      // The q and k norms come last, over one head each.
      const bool per_head = qk_norms && i >= norms_per_layer - 2;
      const size_t which = per_head ? kQNorm + (i - (norms_per_layer - 2)) : i;
      TORCH_CHECK(is_bf16(norm) && norm.numel() == (per_head ? head_dim : hidden),
                  "decode_rows: a norm's weight must be contiguous bfloat16 [",
                  per_head ? "head_dim" : "hidden", "]");
      weights[l].norm[which] = norm.data_ptr<Bf16>();
    }
    const at::Tensor& cache = kv_caches_[l];
    TORCH_CHECK(is_bf16(cache) && cache.dim() == 5 && cache.size(0) == 2 &&
                    cache.size(1) == kv_caches_[0].size(1) && cache.size(2) == kv_heads &&
                    cache.size(3) == block_size && cache.size(4) == head_dim,
                "decode_rows: every kv cache must be contiguous bfloat16 [2, num_blocks, ",
                kv_heads, ", ", block_size, ", ", head_dim, "]");
  }
  st.num_blocks = kv_caches_[0].size(1);
  TORCH_CHECK(is_bf16(embedding) && embedding.dim() == 2 && embedding.size(1) == hidden,
              "decode_rows: the embedding must be contiguous bfloat16 [vocab, ", hidden, "]");
  TORCH_CHECK(is_bf16(final_norm) && final_norm.numel() == hidden,
              "decode_rows: the final norm's weight must be contiguous bfloat16 [", hidden, "]");
  st.vocab = embedding.size(0);
  st.embedding = std::move(embedding);
  st.final_norm = std::move(final_norm);
  // DecoderLM.forward: x * tensor(scale, float32).to(bfloat16), a bfloat16 product
  st.embed_scale = embed_scale == 0.0 ? 0.0f
                                      : static_cast<float>(Bf16(static_cast<float>(embed_scale)));
  for (const at::Tensor& cache : kv_caches_) st.caches.push_back(cache.data_ptr<Bf16>());
  state_ = std::move(state);
}

