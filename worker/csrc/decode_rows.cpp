// decode_layers on raw rows, no tensor made inside the loop but GGUF projections' own: a
// step of one or two rows on the GEMV over plain weights, a step of any rows where bf16_gemm
// packs (AVX512-BF16, no AMX) on the GEMM over its packed ones (whichever the Python
// layers' PackedLinear picks for these rows, NativeOps.small_batch_linear), or a step of
// --quantization gguf's projections on gguf_linear, up to the rows every QuantLinear fuses
// (the caller's limit), with the float32 biases QuantLinear holds (Qwen2's q/k/v):
// gguf_linear's float32 product, bias added, is rounded to bfloat16 here, as
// QuantLinear.forward's .to() rounds it; or a step of any rows of --quantization int8's
// projections on int8_linear, its rows quantized in each call as Int8Linear.forward's are.
//
// At one row a layer's four projections stream ~7 MB of weights in ~250 us, and the ops
// between them compute almost nothing; through ATen each of them still made a tensor (or
// a view) and went through the dispatcher, ~1 ms a SmolLM2 step in all (perf: a tenth of
// the main thread in ATen and malloc, the other thread waiting for it). The same holds at
// 8 and 32 rows on the GEMM: 7.6 -> 7.3 ms and 15.2-15.6 -> 14.6-14.9 ms a step in process
// (docs/benchmarks.md); at 64 rows level. Here the same
// kernels run on raw pointers into one scratch buffer, in the same order on the same
// values, so the results are bit-identical to decode_layers' tensor path and to the
// Python layers (tests/unit/test_decode_stack.py). Layers of other shapes than Llama's
// (Qwen3's q/k norms; Gemma 3's (1 + w), q/k and sandwich norms, GeGLU and two RoPEs) run
// here too, told by flags (kernels.h), in DecoderLayer.forward's order for them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <limits>
#include <optional>
#include <vector>

#include "decode_rows_plan.h"
#include "kernels.h"
#include "simd.h"

using tandem::decode_rows::Bf16;
using tandem::decode_rows::is_bf16;
using tandem::decode_rows::LayerWeights;

namespace {


// out = T(a + b), as at::add rounds a bfloat16 sum: in float32, once. Split between threads
// past at::add's grain, as at::add is.
void add_rows(const Bf16* a, const Bf16* b, Bf16* out, int64_t count) {
  at::parallel_for(0, count, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    int64_t j = begin;
#if defined(__AVX512F__)
    for (; j + tandem::kLanes <= end; j += tandem::kLanes)
      tandem::store_lanes(out + j,
                          _mm512_add_ps(tandem::load_lanes(a + j), tandem::load_lanes(b + j)));
#endif
    for (; j < end; ++j) out[j] = Bf16(static_cast<float>(a[j]) + static_cast<float>(b[j]));
  });
}

const uint16_t* bits(const Bf16* p) { return reinterpret_cast<const uint16_t*>(p); }


// One projection's GGUF weight: `count` segments (consecutive outputs of one ggml type, as
// QuantLinear.segments), segment s of type types[s] in blocks[s], its quants gguf_gemm_pack
// repacked in packed[s] (an empty tensor where it has none); the projection's float32 bias
// (null where none).
struct GgufWeight {
  const at::Tensor* blocks;
  const at::Tensor* packed;
  const int64_t* types;
  size_t count;
  const at::Tensor* bias;
  bool q8;  // 8-bit activations (gguf_linear_q8)
};

// One projection's int8 weight (int8_pack's panels, row sums and scales) and its float32
// bias (null where none).
struct Int8Weight {
  const at::Tensor* packed;
  const at::Tensor* sums;
  const at::Tensor* scales;
  const at::Tensor* bias;
};

// y = x W^T (+ b) for n rows, on the kernel for the weights' layout.
struct Projection {
  bool gemm;  // bf16_gemm_pack's layout, on bf16_gemm; else the plain [out, in] one, on the GEMV

  // `then`: the GEMM's next weight (bf16_gemm_rows), if the caller knows it.
  void operator()(const Bf16* x, const Bf16* w, const Bf16* b, Bf16* y, int64_t n, int64_t out,
                  int64_t in, const Bf16GemmNext* then = nullptr) const {
    if (gemm)
      bf16_gemm_rows(bits(x), bits(w), bits(b), reinterpret_cast<uint16_t*>(y), n, out, in, then);
    else
      bf16_gemv_rows(bits(x), bits(w), bits(b), reinterpret_cast<uint16_t*>(y), n, out, in);
  }

  // QuantLinear.forward for n bfloat16 rows: each segment's float32 product from gguf_linear
  // into its columns of y, the bias added (in float32, as QuantLinear adds it, in the kernel
  // or after), rounded once.
  void operator()(const Bf16* x, const GgufWeight& w, Bf16* y, int64_t n, int64_t out,
                  int64_t in) const {
    const at::Tensor rows = at::from_blob(const_cast<Bf16*>(x), {n, in}, at::kBFloat16);
    const float* bias = w.bias ? w.bias->data_ptr<float>() : nullptr;
    int64_t first = 0;
    for (size_t s = 0; s < w.count; ++s) {
      const at::Tensor product =
          gguf_linear(rows, w.blocks[s], w.types[s], std::nullopt, w.packed[s], false, w.q8);
      const int64_t width = w.blocks[s].size(0);
      const float* b = bias ? bias + first : nullptr;
      for (int64_t r = 0; r < n; ++r) {
        const float* p = product.data_ptr<float>() + r * width;
        Bf16* row = y + r * out + first;
        int64_t j = 0;
#if defined(__AVX512F__)
        for (; j + tandem::kLanes <= width; j += tandem::kLanes) {
          const __m512 v = _mm512_loadu_ps(p + j);
          tandem::store_lanes(row + j, b ? _mm512_add_ps(v, _mm512_loadu_ps(b + j)) : v);
        }
#endif
        for (; j < width; ++j) row[j] = Bf16(b ? p[j] + b[j] : p[j]);
      }
      first += width;
    }
  }
};

// Int8Linear.forward for n bfloat16 rows: int8_linear's rows, straight into y.
void project_int8(const Bf16* x, const Int8Weight& w, Bf16* y, int64_t n, int64_t out,
                  int64_t in) {
  const at::Tensor rows = at::from_blob(const_cast<Bf16*>(x), {n, in}, at::kBFloat16);
  at::Tensor into = at::from_blob(y, {n, out}, at::kBFloat16);
  int8_linear_into(rows, *w.packed, *w.sums, *w.scales,
                   w.bias != nullptr ? w.bias->data_ptr<float>() : nullptr, -1, into);
}

// Adds each phase's wall time on the calling thread to seconds[phase] (DecodePhase), where
// the caller asked for it; otherwise reads no clock.
class PhaseClock {
 public:
  explicit PhaseClock(double* seconds) : seconds_(seconds), last_(seconds ? now() : 0.0) {}

  // The time since the last lap was `phase`'s.
  void lap(DecodePhase phase) {
    if (seconds_ == nullptr) return;
    const double t = now();
    seconds_[phase] += t - last_;
    last_ = t;
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  double* seconds_;
  double last_;
};

// The step's row buffers, carved out of one tensor.
struct Rows {
  Bf16 *h, *qkv, *q, *attn, *o, *residual, *gate_up, *act, *down;
};

}  // namespace

std::vector<std::string> decode_rows_phases() {
  return {"projections", "attention", "rotary + KV write", "norms + adds", "activation"};
}

int64_t decode_rows_max_rows(bool gemm) {
  if (gemm) return has_bf16_gemm() ? std::numeric_limits<int64_t>::max() : 0;
  return bf16_gemv_rows_on_every_host();
}

at::Tensor DecodeRowsPlan::run(const at::Tensor& ids, const at::Tensor& slots,
                               const at::Tensor& block_table, const at::Tensor& context_lens,
                               const std::vector<at::Tensor>& cos,
                               const std::vector<at::Tensor>& sin,
                               const std::optional<at::Tensor>& phase_seconds) const {
  const State& st = *state_;
  TORCH_CHECK(!phase_seconds || (phase_seconds->scalar_type() == at::kDouble &&
                                 phase_seconds->is_contiguous() &&
                                 phase_seconds->numel() == kDecodePhases),
              "decode_rows: phase_seconds must be contiguous float64 [", kDecodePhases, "]");
  const int64_t hidden = st.hidden, heads = st.heads, kv_heads = st.kv_heads;
  const int64_t head_dim = st.head_dim, block_size = st.block_size, inter = st.inter;
  const int64_t q_dim = st.q_dim, qkv_dim = st.qkv_dim, num_blocks = st.num_blocks;
  const bool gguf = st.gguf, qk_norms = st.qk_norms, sandwich_norms = st.sandwich_norms;
  const bool gemma_norms = st.gemma_norms;
  const double eps = st.eps, scale = st.scale;
  const Projection project{st.gemm};
  const std::vector<LayerWeights>& weights = st.weights;
  const std::vector<size_t>& first_segment = st.first_segment;
  const auto& shapes = st.shapes;
  const size_t layers = weights.size();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 1,
              "decode_rows: token ids must be contiguous int64 [n]");
  const int64_t n = ids.size(0);
  TORCH_CHECK(n >= 1 && (gguf || st.int8 || n <= decode_rows_max_rows(project.gemm)),
              "decode_rows takes 1 to ", decode_rows_max_rows(project.gemm), " rows",
              project.gemm ? " on the GEMM" : " on the GEMV", ", got ", n);
  TORCH_CHECK(static_cast<int64_t>(cos.size()) == st.num_ropes &&
                  static_cast<int64_t>(sin.size()) == st.num_ropes,
              "decode_rows: a cos and a sin for each of the layers' ", st.num_ropes, " RoPEs");
  for (int64_t i = 0; i < st.num_ropes; ++i)
    TORCH_CHECK(is_bf16(cos[i]) && is_bf16(sin[i]) && cos[i].numel() == n * head_dim &&
                    sin[i].numel() == n * head_dim,
                "decode_rows: cos and sin must be contiguous bfloat16 [n, head_dim]");

  // Once for every layer: what write_kv and decode_attention check on each call.
  const int64_t num_slots = num_blocks * block_size;
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slots must be contiguous int64 [n]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "slot out of range");
  check_decode_metadata(block_table, context_lens, n, num_blocks, block_size);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < st.vocab, "decode_rows: token id ", id[i], " out of range");

  const int64_t widths[] = {hidden, hidden, hidden, qkv_dim, q_dim, q_dim, hidden, hidden,
                            2 * inter, inter, hidden};
  int64_t total = 0;
  for (const int64_t w : widths) total += n * w;
  const at::TensorOptions bf16 = at::TensorOptions().dtype(at::kBFloat16);
  at::Tensor scratch = at::empty({total}, bf16);
  Bf16* next = scratch.data_ptr<Bf16>();
  Rows r{};
  Bf16 *embedded = nullptr, *x = nullptr;  // the step's input rows; each layer's output
  Bf16** fields[] = {&embedded, &x, &r.h, &r.qkv, &r.q, &r.attn, &r.o, &r.residual,
                     &r.gate_up, &r.act, &r.down};
  for (size_t i = 0; i < std::size(widths); ++i) {
    *fields[i] = next;
    next += n * widths[i];
  }
  // DecoderLM._embed (one rank), then its embed_scale as a bfloat16 product.
  const Bf16* table = st.embedding.data_ptr<Bf16>();
  for (int64_t i = 0; i < n; ++i) {
    const Bf16* row = table + id[i] * hidden;
    if (st.embed_scale == 0.0f)
      std::copy(row, row + hidden, embedded + i * hidden);
    else
      for (int64_t j = 0; j < hidden; ++j)
        embedded[i * hidden + j] = Bf16(static_cast<float>(row[j]) * st.embed_scale);
  }
  const Bf16* x_cur = embedded;
  const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(Bf16));
  PhaseClock clock(phase_seconds ? phase_seconds->data_ptr<double>() : nullptr);
  // Read once, not once a layer: each data_ptr checks its tensor, over cold caches here.
  std::vector<const Bf16*> cos_rows, sin_rows;
  for (int64_t i = 0; i < st.num_ropes; ++i) {
    cos_rows.push_back(cos[i].data_ptr<Bf16>());
    sin_rows.push_back(sin[i].data_ptr<Bf16>());
  }
  const int64_t* table_ids = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t table_width = block_table.size(1);

  for (size_t l = 0; l < layers; ++l) {
    const LayerWeights& w = weights[l];
    // The GEMM weight after projection i, fetched while i's last groups compute (o's too,
    // though attention runs in between: 32-row steps' projections took 0-4% less time with
    // it than without; docs/benchmarks.md).
    const auto after = [&](size_t i) -> std::optional<Bf16GemmNext> {
      if (i == kLinearsPerLayer - 1 && l + 1 == layers) return std::nullopt;
      const size_t j = (i + 1) % kLinearsPerLayer;
      const Bf16* weight = j == 0 ? weights[l + 1].weight[0] : w.weight[j];
      return Bf16GemmNext{bits(weight), shapes[j][0], shapes[j][1]};
    };
    // Projection i of this layer, x [n, in] -> y [n, out].
    const auto linear = [&](size_t i, const Bf16* x_rows, Bf16* y, int64_t out, int64_t in) {
      const size_t at = l * kLinearsPerLayer + i;
      const bool biased = i < kBiasesPerLayer;  // qkv and o
      if (gguf) {
        const size_t first = first_segment[at];
        project(x_rows,
                GgufWeight{&st.projections[first], &st.gguf_packed[first], &st.gguf_types[first],
                           first_segment[at + 1] - first, biased ? w.float_bias[i] : nullptr,
                           st.gguf_q8},
                y, n, out, in);
      } else if (st.int8) {
        project_int8(x_rows,
                     Int8Weight{&st.projections[at], &st.int8_sums[at], &st.int8_scales[at],
                                biased ? w.float_bias[i] : nullptr},
                     y, n, out, in);
      } else {
        const std::optional<Bf16GemmNext> then = project.gemm ? after(i) : std::nullopt;
        project(x_rows, w.weight[i], biased ? w.bias[i] : nullptr, y, n, out, in,
                then ? &*then : nullptr);
      }
    };
    Bf16* cache = st.caches[l];
    const size_t rope = static_cast<size_t>(st.rope_of_layer[l]);
    // RMSNorm by this layer's norm `which` (a NormSlot), in the model's style.
    const auto norm = [&](const Bf16* rows, const Bf16* add, NormSlot which, Bf16* out,
                          Bf16* residual, int64_t count, int64_t width) {
      rms_norm_bf16(rows, add, w.norm[which], out, residual, count, width, eps, gemma_norms);
    };
    // Attention.forward
    norm(x_cur, nullptr, kInputNorm, r.h, nullptr, n, hidden);
    clock.lap(kPhaseNorms);
    linear(0, r.h, r.qkv, qkv_dim, hidden);
    clock.lap(kPhaseProjections);
    if (qk_norms)  // each head of q, then of k, in place: rotary reads them next
      for (int64_t i = 0; i < n; ++i) {
        Bf16* row = r.qkv + i * qkv_dim;
        norm(row, nullptr, kQNorm, row, nullptr, heads, head_dim);
        norm(row + q_dim, nullptr, kKNorm, row + q_dim, nullptr, kv_heads, head_dim);
      }
    clock.lap(kPhaseNorms);
    rotary_bf16(r.qkv, qkv_dim, cos_rows[rope], sin_rows[rope], n, heads + kv_heads, head_dim);
    write_kv_rows(reinterpret_cast<char*>(cache), slot, n, kv_heads, block_size, num_slots, bytes,
                  reinterpret_cast<const char*>(r.qkv + q_dim), qkv_dim * sizeof(Bf16),
                  reinterpret_cast<const char*>(r.qkv + q_dim + kv_heads * head_dim),
                  qkv_dim * sizeof(Bf16));
    for (int64_t i = 0; i < n; ++i)  // the query heads, contiguous
      std::copy(r.qkv + i * qkv_dim, r.qkv + i * qkv_dim + q_dim, r.q + i * q_dim);
    clock.lap(kPhaseRopeKv);
    decode_attention_bf16_rows(tandem::attention::Problem<Bf16>{
        r.q, cache, cache + num_blocks * kv_heads * block_size * head_dim,
        table_ids, lens, r.attn, n, heads, kv_heads, head_dim, table_width, block_size,
        st.windows[l],
        static_cast<float>(scale)});
    clock.lap(kPhaseAttention);
    linear(1, r.attn, r.o, hidden, q_dim);
    clock.lap(kPhaseProjections);
    if (sandwich_norms) {  // DecoderLayer.forward: x + post(attn), then pre(...) into the MLP
      norm(r.o, nullptr, kPostAttentionNorm, r.h, nullptr, n, hidden);
      add_rows(x_cur, r.h, r.residual, n * hidden);
      norm(r.residual, nullptr, kPreFeedforwardNorm, r.h, nullptr, n, hidden);
    } else {  // x, h = add_and_norm(x, attn)
      norm(x_cur, r.o, kPostAttentionNorm, r.h, r.residual, n, hidden);
    }
    clock.lap(kPhaseNorms);
    linear(2, r.h, r.gate_up, 2 * inter, hidden);
    clock.lap(kPhaseProjections);
    act_mul_bf16(r.gate_up, r.act, n, inter, st.act);
    clock.lap(kPhaseActivation);
    linear(3, r.act, r.down, hidden, inter);
    clock.lap(kPhaseProjections);
    if (sandwich_norms)  // x + post_feedforward(mlp(h)), the norm in place
      norm(r.down, nullptr, kPostFeedforwardNorm, r.down, nullptr, n, hidden);
    add_rows(r.residual, r.down, x, n * hidden);
    clock.lap(kPhaseNorms);
    x_cur = x;
  }
  // The model's final norm, as DecoderLM.forward applies it after the layers.
  at::Tensor out = at::empty({n, hidden}, bf16);
  rms_norm_bf16(x_cur, nullptr, st.final_norm.data_ptr<Bf16>(), out.data_ptr<Bf16>(), nullptr, n,
                hidden, eps, gemma_norms);
  clock.lap(kPhaseNorms);
  return out;
}
