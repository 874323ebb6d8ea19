// Small fused steps of a decoder layer, each one pass instead of several PyTorch ops,
// rounding where transformers' eager code rounds so bfloat16 results match it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels.h"
#include "simd.h"

using tandem::check_cpu;
using tandem::dispatch_float_types;

// write_kv's copies, on raw rows: bytes per head row, k's and v's row strides in bytes.
void write_kv_rows(char* cache, const int64_t* slot, int64_t n, int64_t kv_heads,
                   int64_t block_size, int64_t num_slots, int64_t bytes, const char* k_data,
                   int64_t k_stride, const char* v_data, int64_t v_stride) {
  const int64_t half = num_slots * kv_heads * bytes;  // K, then V
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = slot[i] / block_size, offset = slot[i] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = ((block * kv_heads + h) * block_size + offset) * bytes;
      std::memcpy(cache + dst, k_data + i * k_stride + h * bytes, bytes);
      std::memcpy(cache + half + dst, v_data + i * v_stride + h * bytes, bytes);
    }
  }
}

// Token slot s = block * B + offset of a layer's cache [2, num_blocks, kv_heads, B, dim]
// (each KV head's rows of a block contiguous): for every head h,
// kv_cache[0, block, h, offset] = k[i, h] and kv_cache[1, ...] = v[i, h]  (k, v: [n, kv_heads, dim]).
void write_kv(at::Tensor& kv_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  check_cpu("write_kv", kv_cache, slots, k, v);
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be contiguous [2, num_blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "slots must be contiguous int64 [n]");
  const int64_t n = slots.size(0), kv_heads = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t num_slots = kv_cache.size(1) * block_size, dim = kv_cache.size(4);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == kv_heads && t->size(2) == dim &&
                    t->stride(2) == 1 && t->stride(1) == dim &&
                    t->scalar_type() == kv_cache.scalar_type(),
                "k and v must be [n, kv_heads, dim] with contiguous rows, like kv_cache");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "slot out of range");
  const int64_t elem = kv_cache.element_size();
  write_kv_rows(static_cast<char*>(kv_cache.data_ptr()), slot, n, kv_heads, block_size,
                num_slots, dim * elem, static_cast<const char*>(k.data_ptr()), k.stride(0) * elem,
                static_cast<const char*>(v.data_ptr()), v.stride(0) * elem);
}

namespace {

template <typename T>
void rotary_rows(T* data, int64_t stride, const T* c, const T* s, int64_t n, int64_t heads,
                 int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* ci = c + i * dim;
      const T* si = s + i * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = data + i * stride + h * dim;
        int64_t j = 0;
#if defined(__AVX512F__)
        if (half % tandem::kLanes == 0) {
          using tandem::load_lanes;
          using tandem::round_lanes;
          for (; j < half; j += tandem::kLanes) {
            const __m512 x1 = load_lanes(row + j), x2 = load_lanes(row + j + half);
            const __m512 a1 = round_lanes<T>(_mm512_mul_ps(x1, load_lanes(ci + j)));
            const __m512 b1 = round_lanes<T>(
                _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load_lanes(si + j)));
            const __m512 a2 = round_lanes<T>(_mm512_mul_ps(x2, load_lanes(ci + j + half)));
            const __m512 b2 = round_lanes<T>(_mm512_mul_ps(x1, load_lanes(si + j + half)));
            tandem::store_lanes(row + j, _mm512_add_ps(a1, b1));
            tandem::store_lanes(row + j + half, _mm512_add_ps(a2, b2));
          }
        }
#endif
        for (; j < half; ++j) {
          const float x1 = static_cast<float>(row[j]), x2 = static_cast<float>(row[j + half]);
          // Each product is rounded to T, then their sum: as x * cos + rot * sin in T.
          const T a1 = static_cast<T>(x1 * static_cast<float>(ci[j]));
          const T b1 = static_cast<T>(-x2 * static_cast<float>(si[j]));
          const T a2 = static_cast<T>(x2 * static_cast<float>(ci[j + half]));
          const T b2 = static_cast<T>(x1 * static_cast<float>(si[j + half]));
          row[j] = static_cast<T>(static_cast<float>(a1) + static_cast<float>(b1));
          row[j + half] = static_cast<T>(static_cast<float>(a2) + static_cast<float>(b2));
        }
      }
    }
  });
}

// act(x) = x * sigmoid(s(x)): silu s(x) = x; GeGLU's tanh-approximated gelu
// 0.5 x (1 + tanh(c (x + 0.044715 x^3))) is the same form with s(x) = 2c (x + 0.044715 x^3),
// since 0.5 (1 + tanh(y)) = sigmoid(2 y). One exp a value either way.
constexpr float kGeluCubic = 0.044715f;
constexpr float kGeluTwiceSqrt2OverPi = 1.5957691216057308f;  // 2 sqrt(2 / pi)

inline float sigmoid_input(float x, Activation act) {
  return act == Activation::kSilu ? x : kGeluTwiceSqrt2OverPi * (x + kGeluCubic * x * x * x);
}

template <typename T>
void act_mul_rows(const T* in, T* dst, int64_t n, int64_t d, Activation act) {
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = in + i * 2 * d;
      const T* u = g + d;
      T* o = dst + i * d;
      int64_t j = 0;
#if defined(__AVX512F__)
      using tandem::load_lanes;
      const bool gelu = act == Activation::kGeluTanh;
      const __m512 cubic = _mm512_set1_ps(kGeluCubic);
      const __m512 scale = _mm512_set1_ps(kGeluTwiceSqrt2OverPi);
      for (; j + tandem::kLanes <= d; j += tandem::kLanes) {
        const __m512 x = load_lanes(g + j);
        // gelu: 2c (x + 0.044715 x^3), the cubic term as (0.044715 x) x^2 + x
        const __m512 s = gelu ? _mm512_mul_ps(scale, _mm512_fmadd_ps(_mm512_mul_ps(cubic, x),
                                                                     _mm512_mul_ps(x, x), x))
                              : x;
        const __m512 e = tandem::exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), s));
        const __m512 value = tandem::round_lanes<T>(
            _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        tandem::store_lanes(o + j, _mm512_mul_ps(value, load_lanes(u + j)));
      }
#endif
      for (; j < d; ++j) {
        const float x = static_cast<float>(g[j]);
        const T value = static_cast<T>(x / (1.f + std::exp(-sigmoid_input(x, act))));
        o[j] = static_cast<T>(static_cast<float>(value) * static_cast<float>(u[j]));
      }
    }
  });
}

}  // namespace

void rotary_bf16(c10::BFloat16* x, int64_t stride, const c10::BFloat16* cos,
                 const c10::BFloat16* sin, int64_t n, int64_t heads, int64_t dim) {
  rotary_rows(x, stride, cos, sin, n, heads, dim);
}

void act_mul_bf16(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t n, int64_t d,
                  Activation act) {
  act_mul_rows(gate_up, out, n, d, act);
}

// In place on the first `heads` heads of x [n, >=heads, dim] (rows contiguous):
// x = T(x * cos) + T(rotate_half(x) * sin), rotate_half(x) = cat(-x2, x1); cos/sin [n, dim].
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_cpu("rotary", x, cos, sin);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && heads <= x.size(1),
              "x must be [n, heads, dim] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous [n, dim] in x's dtype");
  dispatch_float_types(x.scalar_type(), "rotary", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows(x.data_ptr<T>(), x.stride(0), cos.data_ptr<T>(), sin.data_ptr<T>(), x.size(0),
                heads, x.size(2));
  });
}

// gate_up [n, 2 * d] -> T(T(act(gate)) * up), [n, d]; act by its Activation code.
at::Tensor act_mul(const at::Tensor& gate_up, int64_t activation) {
  check_cpu("act_mul", gate_up);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [n, 2 * d]");
  const Activation act = activation_of(activation);
  const int64_t n = gate_up.size(0), d = gate_up.size(1) / 2;
  auto out = at::empty({n, d}, gate_up.options());
  dispatch_float_types(gate_up.scalar_type(), "act_mul", [&](auto tag) {
    using T = decltype(tag);
    act_mul_rows(gate_up.data_ptr<T>(), out.data_ptr<T>(), n, d, act);
  });
  return out;
}

// Structured outputs: logits[r, t] = -inf where bit t of mask row r is clear (or t is past
// the mask). logits: float32 [rows, vocab] contiguous; mask: int32 [rows, words].
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& mask) {
  check_cpu("apply_token_bitmask", logits, mask);
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(mask.dim() == 2 && mask.is_contiguous() && mask.scalar_type() == at::kInt &&
                  mask.size(0) == logits.size(0),
              "mask must be contiguous int32 [rows, words]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = mask.size(1);
  const int64_t covered = std::min<int64_t>(vocab, words * 32);
  float* data = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + r * vocab;
      const uint32_t* row_bits = bits + r * words;
      for (int64_t w = 0; w * 32 < covered; ++w) {
        const uint32_t word = row_bits[w];
        if (word == 0xFFFFFFFFu) continue;  // all allowed
        const int64_t first = w * 32, last = std::min<int64_t>(first + 32, covered);
        if (word == 0) {  // none allowed: the common case under a grammar
          std::fill(row + first, row + last, ninf);
          continue;
        }
        for (int64_t t = first; t < last; ++t)
          if (!((word >> (t - first)) & 1u)) row[t] = ninf;
      }
      for (int64_t t = covered; t < vocab; ++t) row[t] = ninf;
    }
  });
}

namespace {

// The index of row[0 .. n)'s first maximum; of its first NaN if it has one (as
// torch.max(dim=-1) answers).
template <typename T>
int64_t first_max(const T* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; t + tandem::kLanes <= n; t += tandem::kLanes) {
    const __m512 v = tandem::load_lanes(row + t);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  best = _mm512_reduce_max_ps(top);
  nan = unordered != 0;
#endif
  for (; t < n; ++t) {
    const float v = static_cast<float>(row[t]);
    nan = nan || std::isnan(v);
    best = std::max(best, v);
  }
  // The second pass reads the row from cache, and stops at the first match.
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; i + tandem::kLanes <= n; i += tandem::kLanes) {
    const __m512 v = tandem::load_lanes(row + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (nan ? std::isnan(v) : v == best) return i;
  }
  return 0;  // n == 0 is refused by the caller
}

}  // namespace

// Greedy sampling: the index of each row's first maximum of x [rows, vocab] (float32,
// bfloat16 or float16, contiguous), as int64 [rows]; equal to x.max(dim=-1).indices, read
// in x's own dtype (no float32 copy of the logits).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu("argmax_rows", x);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows takes contiguous [rows, vocab] logits with vocab > 0");
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  tandem::dispatch_float_types(x.scalar_type(), "argmax_rows", [&](auto zero) {
    using T = decltype(zero);
    const T* data = reinterpret_cast<const T*>(x.data_ptr());
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) index[r] = first_max(data + r * vocab, vocab);
    });
  });
  return out;
}
