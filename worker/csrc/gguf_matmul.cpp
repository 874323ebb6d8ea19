// GGUF projections of bfloat16 rows past gguf_linear's (prefill chunks of a bfloat16 model
// under --quantization gguf), where bf16_gemm takes a bfloat16 model's projections
// (AVX512-BF16, no AMX): y = x W^T (+ b), bfloat16 out.
//
// Before, QuantLinear dequantized the whole weight to bfloat16 for the call and ran ATen's
// matmul on it, which reorders the weight into oneDNN's layout on every call: on a Zen 5,
// over SmolLM2's projections for the chat wave's 1,432-row prefill, 326-400 ms against
// bf16_gemm's 312-329 on weights packed at load (the dequantization itself ~4). Here each group
// of bf16_gemm's 32 outputs is dequantized into a thread's buffer and laid out as
// bf16_gemm_pack lays out a group, both in L1 or L2, and every row of x runs through
// bf16_gemm's tiles over it: the file's blocks are read once and no whole weight is written.
// The weights are gguf_dequantize's bfloat16 values and the sums bf16_gemm's, so the result
// is bit for bit bf16_gemm(x, bf16_gemm_pack(gguf_dequantize(weight, type, in, true)), b):
// what QuantLinear computed before, up to the matmul's order of summing.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "gguf_formats.h"
#include "kernels.h"
#include "parallel.h"

using namespace tandem::gguf;

at::Tensor gguf_bf16_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_gemm_packs(),
              "gguf_bf16_matmul: bfloat16 projections do not run on bf16_gemm on this CPU");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.is_contiguous(),
              "gguf_bf16_matmul: x is a contiguous CPU bfloat16 [rows, in] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "gguf_bf16_matmul: the bias is a contiguous bfloat16 [out] tensor");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  with_format(type, [&](auto format) {
    using F = decltype(format);
    // in_features is a whole number of blocks (32 or 256 weights): whole bfloat16 pairs.
    const int64_t blocks = checked_blocks<F>("gguf_bf16_matmul", weight, K);
    if (M == 0 || N == 0) return;
    const int64_t outputs = bf16_gemm_group_outputs(), row_bytes = blocks * F::kBytes;
    const uint8_t* w = weight.data_ptr<uint8_t>();
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    uint16_t* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    tandem::parallel_steal((N + outputs - 1) / outputs, [&](int64_t g, int64_t) {
      // A group's rows as gguf_dequantize makes them, then in bf16_gemm's layout.
      thread_local std::vector<c10::BFloat16> rows;
      thread_local std::vector<uint16_t> group;
      rows.resize(outputs * K);
      group.resize(outputs * K);
      const int64_t first = g * outputs, count = std::min(outputs, N - first);
      for (int64_t r = 0; r < count; ++r) {
        const uint8_t* row = w + (first + r) * row_bytes;
        for (int64_t k = 0; k < blocks; ++k)
          dequant_bf16<F>(row + k * F::kBytes, rows.data() + r * K + k * F::kWeights);
      }
      bf16_gemm_pack_group(reinterpret_cast<const uint16_t*>(rows.data()), count, K, group.data());
      bf16_gemm_group(xs, M, K, group.data(), b, first, N, ys);
    });
  });
  return y;
}
