// Every native kernel's signature, one place for the module (module.cpp) and for the
// kernels that call others (decode_stack.cpp): a declaration that drifted from its
// definition would link as an undefined symbol only at import.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention_problem.h"

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& context_lens,
                            double scale, int64_t window, int64_t block_size);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& add,
                                                const at::Tensor& weight, double eps, bool gemma);
void write_kv(at::Tensor& kv_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
// The gated MLPs' activations, by the code Python passes (worker/ops.py's NATIVE_ACTIVATIONS).
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };
inline Activation activation_of(int64_t code) {
  TORCH_CHECK(code == 0 || code == 1, "unknown activation code ", code, " (0 silu, 1 gelu tanh)");
  return static_cast<Activation>(code);
}
at::Tensor act_mul(const at::Tensor& gate_up, int64_t activation);
// LoRA deltas in place: y[rows[i]] += scales[g] * bt[g]^T (a[g] x[rows[i]]) for the rows
// i of group g, [group_starts[g], group_starts[g + 1]); a [r, in], bt [r, out] float32,
// nonzero only in blocks[g]'s (r_lo, r_hi, o_lo, o_hi) rectangles.
void lora_sgmv_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                const at::Tensor& group_starts, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& bt, const std::vector<at::Tensor>& blocks,
                const std::vector<double>& scales);
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& mask);
at::Tensor argmax_rows(const at::Tensor& x);
bool has_bf16_gemv();
int64_t bf16_gemv_max_rows(int64_t out_features, int64_t in_features);
bool has_amx_linear();
int64_t amx_linear_max_rows(int64_t out_features, int64_t in_features);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias);
// Causal attention of one prefill chunk (prefill_attention_bf16.cpp): q [queries, heads,
// dim] at positions offset.., k and v [kv_heads, offset + queries, dim], bfloat16; a
// window > 0 lets the query at t see keys (t - window, t] only.
bool has_bf16_prefill_attention();
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t offset, double scale, int64_t window);
// Fresh prefill chunks of one step (no cached prefix) in one call: chunk c's queries are rows
// [starts[c], ends[c]) of q [tokens, heads, dim], its keys and values the same rows of k and
// v [tokens, kv_heads, dim]; its attention goes to the same rows of out (the others are left
// as they are). Each chunk's result is the one prefill_attention gives it alone.
void prefill_attention_chunks_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& ends, double scale,
                               int64_t window);
bool has_bf16_gemm();
bool bf16_gemm_packs();
at::Tensor bf16_gemm_pack(const at::Tensor& weight);
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed,
                     const std::optional<at::Tensor>& bias);
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t in_features,
                           bool bfloat16);
// GGUF projections of bfloat16 rows past gguf_linear's (prefill chunks), where
// bf16_gemm_packs (gguf_matmul.cpp): bf16_gemm over each group of 32 outputs dequantized
// for the call, bit for bit bf16_gemm(x, bf16_gemm_pack(gguf_dequantize(weight, type, in,
// true)), bias).
at::Tensor gguf_bf16_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                            const std::optional<at::Tensor>& bias);
// bf16_out: the float32 product rounded to bfloat16 (the GEMM writes it so directly).
// q8_activations: x quantized to 8 bits per block of 32 and dotted in integers
// (gguf_linear_q8), else x as it is (exact).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& packed = std::nullopt,
                       bool bf16_out = false, bool q8_activations = false);
// The 8-bit-activation path of gguf_linear (gguf_q8.cpp): x (float32 or bfloat16 rows)
// quantized per block of 32 as gguf_quantize_q8 returns it (q int8 [rows, in], d float32
// [rows, in / 32]: x ~ d q), each weight sub-block dotted with q in integers.
at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                          const float* bias, bool bf16_out);
std::tuple<at::Tensor, at::Tensor> gguf_quantize_q8(const at::Tensor& x);
// The bfloat16-row path of gguf_linear (gguf_bf16_dot.cpp): whether this build takes that
// many rows of a ggml type there, and the product (float32 [rows, out]) where it does.
bool gguf_has_bf16_rows(int64_t type, int64_t rows);
at::Tensor gguf_linear_bf16_rows(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                                 const float* bias);
// The many-bfloat16-row path of gguf_linear (gguf_gemm.cpp): whether this build repacks a
// ggml type's quants for it, the repacked weight, and the product ([rows, out], float32 or,
// bf16_out, rounded to bfloat16).
bool gguf_gemm_packs(int64_t type);
int64_t gguf_gemm_min_rows(int64_t type);  // gguf_linear takes the GEMM from this many rows
at::Tensor gguf_gemm_pack(const at::Tensor& weight, int64_t type, int64_t in_features);
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                     int64_t out_features, const float* bias, bool bf16_out);
// decode_layers' and decode_rows' per-layer argument layout: norms[2 l + i], the
// projections [4 l + i], biases[2 l + i].
constexpr size_t kNormsPerLayer = 2;    // input, post-attention
constexpr size_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down
constexpr size_t kBiasesPerLayer = 2;   // qkv's, o's
// decode_layers' packings[i]: how projection i's packed weight is laid out.
constexpr int64_t kOneDnnPacking = 0;    // torch.ops.mkldnn._reorder_linear_weight's
constexpr int64_t kBf16GemmPacking = 1;  // bf16_gemm_pack's
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
                         int64_t block_size, double eps, double scale);

// The same kernels on raw bfloat16 rows, for decode_rows.cpp's step of one or two rows, where
// making a tensor per op cost more than the op: each computes exactly what its tensor
// entry point above computes, which checks its arguments; these check nothing (but
// bf16_gemv_rows, that this build has the GEMV).
// rms_norm_bf16 may write out over x: each row is read whole before it is written.
void rms_norm_bf16(const c10::BFloat16* x, const c10::BFloat16* add, const c10::BFloat16* weight,
                   c10::BFloat16* out, c10::BFloat16* residual, int64_t rows, int64_t dim,
                   double eps, bool gemma);
void rotary_bf16(c10::BFloat16* x, int64_t stride, const c10::BFloat16* cos,
                 const c10::BFloat16* sin, int64_t n, int64_t heads, int64_t dim);
void write_kv_rows(char* cache, const int64_t* slot, int64_t n, int64_t kv_heads,
                   int64_t block_size, int64_t num_slots, int64_t bytes, const char* k_data,
                   int64_t k_stride, const char* v_data, int64_t v_stride);
void act_mul_bf16(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t n, int64_t d,
                  Activation act);
void bf16_gemv_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                    int64_t M, int64_t N, int64_t K);
// bf16_gemm on raw rows of an even in_features (whole bfloat16 pairs), over a weight that
// bf16_gemm_holds; bf16_gemm_rows checks only that this build has the kernel. `then`, if
// given, is the packed weight the caller projects with next: each thread fetches its first
// weights of that call into cache while it computes its last of this one.
bool bf16_gemm_holds(const at::Tensor& packed, int64_t out_features, int64_t in_features);
struct Bf16GemmNext {
  const uint16_t* packed;
  int64_t out_features, in_features;
};
void bf16_gemm_rows(const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
                    uint16_t* y, int64_t rows, int64_t out_features, int64_t in_features,
                    const Bf16GemmNext* then = nullptr);
// bf16_gemm_pack one group at a time, for weights made on the fly: a group is the next
// bf16_gemm_group_outputs() outputs; bf16_gemm_pack_group lays out rows [count, in] (count
// up to a group's outputs; zeros past them and past an odd in) as bf16_gemm_pack lays out
// a group, 16 ceil(count / 16) x 2 ceil(in / 2) elements; bf16_gemm_group computes y's
// outputs from out0 (a group's first) for every row of x over it, as bf16_gemm_rows does.
int64_t bf16_gemm_group_outputs();
void bf16_gemm_pack_group(const uint16_t* rows, int64_t count, int64_t in_features,
                          uint16_t* group);
void bf16_gemm_group(const uint16_t* x, int64_t rows, int64_t in_features, const uint16_t* group,
                     const uint16_t* bias, int64_t out0, int64_t out_features, uint16_t* y);
// The rows bf16_gemv runs on bf16_gemv_rows on any host (from kAmxFromRows it may take AMX).
int64_t bf16_gemv_rows_on_every_host();
void decode_attention_bf16_rows(const tandem::attention::Problem<c10::BFloat16>& p);
// decode_attention's checks of its metadata: dtypes, shapes, every length and block id in range.
void check_decode_metadata(const at::Tensor& block_table, const at::Tensor& context_lens,
                           int64_t n, int64_t num_blocks, int64_t block_size);
// decode_layers for steps of up to decode_rows_max_rows(gemm) rows (any on the GEMM, one or two on
// the GEMV) where every projection runs on one kernel over raw rows (decode_rows.cpp):
// projections[4 l + i] is layer l's qkv, o, gate_up, down weight, packed by bf16_gemm_pack (gemm)
// or plain [out, in] for the GEMV; or, where gguf_types is not empty, every projection's GGUF
// blocks on gguf_linear, as QuantLinear.segments: projection 4 l + i is the next
// gguf_segments[4 l + i] entries of projections (blocks of one ggml type each, gguf_types[s],
// repacked as gguf_packed[s]) (biases in float32, as QuantLinear holds them; as many rows as the
// caller's QuantLinears fuse). Beyond the Llama shape decode_layers takes, the family's layer
// (DecoderArgs' fields): Gemma's (1 + w) norms (gemma_norms), a norm of each q and k head before
// RoPE (qk_norms: Qwen3, Gemma3), norms after attention and MLP too (sandwich_norms: Gemma3), the
// MLP's Activation by code, and each layer's own cos and sin (Gemma3's local and global RoPE).
// norms[p l + i] is layer l's i-th of p = decode_rows_norms_per_layer: input, post-attention, then
// (sandwich) pre- and post-feedforward, then (qk) q and k, those [head_dim], the others [hidden].
// The other arguments are decode_layers'.
enum NormSlot : size_t {
  kInputNorm, kPostAttentionNorm, kPreFeedforwardNorm, kPostFeedforwardNorm, kQNorm, kKNorm,
  kMaxNormsPerLayer
};
inline size_t decode_rows_norms_per_layer(bool qk_norms, bool sandwich_norms) {
  return 2 + (sandwich_norms ? 2 : 0) + (qk_norms ? 2 : 0);
}
int64_t decode_rows_max_rows(bool gemm);
// What decode_rows' step does, in the order decode_rows_phases() names them: where the caller
// passes phase_seconds (float64 [kDecodePhases]), each phase's wall time on the calling thread,
// its parallel regions' waits included, is added to it (bench.step_profile splits a fused
// step so). Without it no clock is read.
enum DecodePhase : int64_t {
  kPhaseProjections, kPhaseAttention, kPhaseRopeKv, kPhaseNorms, kPhaseActivation, kDecodePhases
};
std::vector<std::string> decode_rows_phases();
// decode_rows, the step described above, for one model: the weights, caches and shape
// checked once, by the constructor (the arguments described above; rope_of_layer[l]: which
// of a step's cos and sin layer l takes); run() checks only the step's own arguments.
// Converting and checking ~300 tensors every step, over caches the step's weights had just
// swept, cost ~0.1 ms of a ~9 ms one-row SmolLM2 step (0.986-0.988x the time without it,
// in process). The plan holds the tensors it was given.
class DecodeRowsPlan {
 public:
  DecodeRowsPlan(std::vector<at::Tensor> norms, std::vector<at::Tensor> projections, bool gemm,
                 std::vector<std::optional<at::Tensor>> biases, std::vector<int64_t> gguf_types,
                 std::vector<at::Tensor> gguf_packed, const std::vector<int64_t>& gguf_segments,
                 bool gguf_q8, std::vector<at::Tensor> int8_sums,
                 std::vector<at::Tensor> int8_scales, bool gemma_norms, bool qk_norms,
                 bool sandwich_norms, int64_t activation,
                 std::vector<at::Tensor> kv_caches, std::vector<int64_t> windows,
                 std::vector<int64_t> rope_of_layer, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, int64_t block_size, double eps, double scale,
                 at::Tensor embedding, double embed_scale, at::Tensor final_norm);
  // Token ids [n] (int64) embedded (times embed_scale where it is not 0), through every
  // layer and the final norm: the hidden rows [n, hidden] the LM head reads. cos[k],
  // sin[k]: [n, head_dim], RoPE k's for the step's positions.
  at::Tensor run(const at::Tensor& ids, const at::Tensor& slots, const at::Tensor& block_table,
                 const at::Tensor& context_lens, const std::vector<at::Tensor>& cos,
                 const std::vector<at::Tensor>& sin,
                 const std::optional<at::Tensor>& phase_seconds) const;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

// W8A8 projections (int8_linear.cpp): int8 weights per output channel in int8_pack's panels,
// int8 activations per row quantized in the call, int32 sums, a float epilogue. `isa` picks
// one of int8_linear_isas() (0 portable, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI, 4 AMX-INT8; -1
// the best).
// Quantized rows are in [-127, 127] (int8_quantize_rows never makes -128; the AVX2 path's
// sign trick and the VNNI paths' offset rely on it); weights take all of int8.
std::vector<int64_t> int8_linear_isas();
at::Tensor int8_pack(const at::Tensor& qweight);
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x);
at::Tensor int8_matmul_int32(const at::Tensor& xq, const at::Tensor& packed,
                             const at::Tensor& weight_sums, int64_t isa);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& weight_sums, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& bias, int64_t isa);
// int8_linear into `out` ([rows, out], x's dtype, contiguous), the float32 bias (or null)
// as a pointer: decode_rows' int8 projections, operands checked once by its plan.
void int8_linear_into(const at::Tensor& x, const at::Tensor& packed,
                      const at::Tensor& weight_sums, const at::Tensor& weight_scales,
                      const float* bias, int64_t isa, at::Tensor& out);
// Whether int8_pack's [panels, padded in * 16] weight holds `out` x `in` (decode_rows' plan).
bool int8_holds(const at::Tensor& packed, const at::Tensor& weight_sums,
                const at::Tensor& weight_scales, int64_t out, int64_t in);

// tandem::parallel_steal over tasks that wait costs_us[i] microseconds each: per task, how
// many times it ran and the thread that ran it (tests only).
at::Tensor parallel_steal_trace(const at::Tensor& costs_us);
