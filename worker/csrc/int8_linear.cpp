// W8A8 projections (`--quantization int8`): y = dequant(q(x) Wq^T) (+ bias).
//
// The weight is int8 per output channel (symmetric: w ~ s_w[n] * Wq[n, k], Wq in
// [-127, 127]), quantized once at load (worker/models/int8_linear.py); each input row is
// quantized here, per token, in the same call (s_x[m] = max|x[m]| / 127, q = round-to-
// nearest-even(x * 127 / max|x[m]|), in [-127, 127]). Products accumulate exactly in int32;
// the float epilogue is y[m, n] = float(acc) * (s_x[m] * s_w[n]) + bias[n], one rounding
// each, in that order, so a float32 reference of the same steps gives the same bits.
//
// The weight is packed in panels of 16 output channels: for each group of 4 inputs, the
// panel's 16 x 4 bytes are adjacent (the layout VPDPBUSD consumes: 4 u8 x s8 products
// summed into each int32 lane). Each ISA path reads the same packing:
//   - AMX-INT8 (Sapphire Rapids and later): int8_amx.cpp's tiles, 32 rows a block, where
//     Linux grants the tile data (the packing is TDPBSSD's right operand as it is);
//   - AVX512-VNNI (Ice Lake, Sapphire Rapids, Zen 4/5): a zmm of the panel per 4 inputs;
//   - AVX-VNNI (Alder Lake, Sapphire Rapids and later): two ymm halves;
//   - AVX2 (Haswell, Zen 1-3): VPMADDUBSW then VPMADDWD, with the sign trick (|w| times
//     sign(w) * x) so no int16 pair sum can saturate (128 * 127 * 2 < 32767): rows are in
//     [-127, 127], weights anywhere in int8 (-128 too: compressed-tensors' symmetric
//     quantization rounds the most negative weight of a row to it);
//   - portable C++ for any other CPU.
// The VNNI paths take the activations as unsigned bytes (q + 128) and subtract 128 * the
// weight row's sum (precomputed at load), which VPDPBUSD's exact int32 sums allow.
// Every path built is callable by its code (int8_linear_isas()), so each is tested on any
// host that has it: a native build on an AMX host holds all five.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "int8_problem.h"
#include "int8_rows.h"
#include "kernels.h"
#include "parallel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using tandem::int8::kBlock;
using tandem::int8::kBlockPanels;
using tandem::int8::kGroup;
using tandem::int8::kPanel;
using tandem::int8::panel_weights;
using tandem::int8::Problem;

constexpr int64_t kRowBlock = 4;     // input rows computed together over a block
constexpr int64_t kRowChunk = 64;    // input rows per task (with one block of panels)

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAmx = 4 };

// Rows per block: the AMX path's two 16-row tiles, the vector paths' register block.
int64_t row_block(int64_t isa) { return isa == kAmx ? tandem::int8::kAmxRows : kRowBlock; }

int64_t padded(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

std::vector<int64_t> isas_built() {
  std::vector<int64_t> isas{kPortable};
#if defined(__AVX2__)
  isas.push_back(kAvx2);
#endif
#if defined(__AVXVNNI__)
  isas.push_back(kAvxVnni);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  isas.push_back(kAvx512Vnni);
#endif
  if (tandem::int8::amx_int8_ready()) isas.push_back(kAmx);
  return isas;
}

bool takes_unsigned(int64_t isa) { return isa == kAvxVnni || isa == kAvx512Vnni; }

inline int32_t group_of(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof(four));
  return four;
}

// acc[r * kBlock + j] for rows [row, row + rows) and panel `panel`'s outputs j.
void panel_portable(const Problem& p, int64_t row, int64_t rows, int64_t panel, int32_t* acc) {
  const int8_t* w = panel_weights(p, panel);
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* x = p.xq + (row + r) * p.kp;
    int32_t* out = acc + r * kBlock;
    for (int64_t j = 0; j < kPanel; ++j) out[j] = 0;
    for (int64_t g = 0; g < p.kp; g += kGroup) {
      const int8_t* wg = w + g * kPanel;
      for (int64_t j = 0; j < kPanel; ++j)
        for (int64_t i = 0; i < kGroup; ++i)
          out[j] += int32_t{x[g + i]} * int32_t{wg[j * kGroup + i]};
    }
  }
}

#if defined(__AVX2__)
// The 256-bit paths: two ymm halves of a panel, rows of the block's panels one at a time.
template <bool kVnni>
void panel_ymm(const Problem& p, int64_t row, int64_t rows, int64_t panel, int32_t* acc) {
  const int8_t* w = panel_weights(p, panel);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[kRowBlock], hi[kRowBlock];
  for (int64_t r = 0; r < kRowBlock; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < p.kp; g += kGroup) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kPanel));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kPanel + 32));
    // |w| as unsigned bytes (|-128| = 128), once a group for every row
    const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256i x = _mm256_set1_epi32(group_of(p.xq + (row + r) * p.kp + g));
      if constexpr (kVnni) {
#if defined(__AVXVNNI__)
        lo[r] = _mm256_dpbusd_avx_epi32(lo[r], x, w0);
        hi[r] = _mm256_dpbusd_avx_epi32(hi[r], x, w1);
#endif
      } else {
        lo[r] = _mm256_add_epi32(
            lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(x, w0)), ones));
        hi[r] = _mm256_add_epi32(
            hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(x, w1)), ones));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlock), lo[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlock + 8), hi[r]);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// R rows by P panels in zmm registers: one broadcast of a row's 4 inputs feeds P sums.
template <int R, int P>
void block_zmm(const Problem& p, int64_t row, int64_t panel0, int32_t* acc) {
  __m512i sum[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) sum[r][q] = _mm512_setzero_si512();
  const int8_t* w = panel_weights(p, panel0);
  const int64_t stride = p.kp * kPanel;
  for (int64_t g = 0; g < p.kp; g += kGroup) {
    __m512i wg[P];
    for (int q = 0; q < P; ++q) wg[q] = _mm512_loadu_si512(w + q * stride + g * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(group_of(p.xq + (row + r) * p.kp + g));
      for (int q = 0; q < P; ++q) sum[r][q] = _mm512_dpbusd_epi32(sum[r][q], x, wg[q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) _mm512_storeu_si512(acc + r * kBlock + q * kPanel, sum[r][q]);
}

template <int R>
void block_zmm_rows(const Problem& p, int64_t row, int64_t panel0, int64_t panels, int32_t* acc) {
  switch (panels) {
    case 1:
      return block_zmm<R, 1>(p, row, panel0, acc);
    case 2:
      return block_zmm<R, 2>(p, row, panel0, acc);
    case 3:
      return block_zmm<R, 3>(p, row, panel0, acc);
    default:
      return block_zmm<R, 4>(p, row, panel0, acc);
  }
}
#endif

// acc for rows [row, row + rows) by panels [panel0, panel0 + panels), on path `isa`.
void run_block(int64_t isa, const Problem& p, int64_t row, int64_t rows, int64_t panel0,
               int64_t panels, int32_t* acc, uint64_t call) {
  switch (isa) {
    case kAmx:
      return tandem::int8::amx_block(p, row, rows, panel0, panels, acc, call);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case kAvx512Vnni:
      switch (rows) {
        case 1:
          return block_zmm_rows<1>(p, row, panel0, panels, acc);
        case 2:
          return block_zmm_rows<2>(p, row, panel0, panels, acc);
        case 3:
          return block_zmm_rows<3>(p, row, panel0, panels, acc);
        default:
          return block_zmm_rows<4>(p, row, panel0, panels, acc);
      }
#endif
#if defined(__AVXVNNI__)
    case kAvxVnni:
      for (int64_t q = 0; q < panels; ++q)
        panel_ymm<true>(p, row, rows, panel0 + q, acc + q * kPanel);
      return;
#endif
#if defined(__AVX2__)
    case kAvx2:
      for (int64_t q = 0; q < panels; ++q)
        panel_ymm<false>(p, row, rows, panel0 + q, acc + q * kPanel);
      return;
#endif
    default:
      for (int64_t q = 0; q < panels; ++q)
        panel_portable(p, row, rows, panel0 + q, acc + q * kPanel);
  }
}

int64_t checked_isa(int64_t isa) {
  const std::vector<int64_t> built = isas_built();
  if (isa < 0) return built.back();
  TORCH_CHECK(std::find(built.begin(), built.end(), isa) != built.end(), "int8_linear: ISA path ",
              isa, " is not built here (built: see int8_linear_isas())");
  return isa;
}

// Runs body(row, rows, first_output, outputs, acc) over every block of rows and panels, in
// parallel, with acc the exact int32 products (the VNNI paths' offset taken back off).
template <typename Body>
void for_each_block(const at::Tensor& xq, const at::Tensor& packed, const at::Tensor& sums,
                    int64_t isa, const Body& body) {
  isa = checked_isa(isa);
  // VPDPBUSD multiplies unsigned bytes: q + 128, and 128 * sum(w) subtracted after.
  const at::Tensor rows = takes_unsigned(isa) ? at::bitwise_xor(xq, -128) : xq;
  const Problem p{rows.data_ptr<int8_t>(), packed.data_ptr<int8_t>(), sums.data_ptr<int32_t>(),
                  xq.size(1), sums.size(0)};
  const int64_t m = xq.size(0);
  const int64_t panels = packed.size(0);
  const int64_t blocks = (panels + kBlockPanels - 1) / kBlockPanels;
  const int64_t chunks = (m + kRowChunk - 1) / kRowChunk;
  const int64_t rows_per_block = row_block(isa);
  const uint64_t call = isa == kAmx ? tandem::int8::amx_begin_call() : 0;
  tandem::parallel_steal(chunks * blocks, [&](int64_t task, int64_t /*next*/) {
    const int64_t chunk = task / blocks, block = task % blocks;
    const int64_t panel0 = block * kBlockPanels;
    const int64_t count = std::min(kBlockPanels, panels - panel0);
    const int64_t first = panel0 * kPanel, outputs = std::min(count * kPanel, p.n - first);
    const int64_t end = std::min(m, (chunk + 1) * kRowChunk);
    alignas(64) int32_t acc[tandem::int8::kAmxRows * kBlock];
    for (int64_t row = chunk * kRowChunk; row < end; row += rows_per_block) {
      const int64_t n_rows = std::min(rows_per_block, end - row);
      run_block(isa, p, row, n_rows, panel0, count, acc, call);
      if (takes_unsigned(isa))
        for (int64_t j = 0; j < outputs; ++j)
          for (int64_t r = 0; r < n_rows; ++r) acc[r * kBlock + j] -= 128 * p.sums[first + j];
      body(row, n_rows, first, outputs, acc);
    }
  });
}

void check_weight(const at::Tensor& packed, const at::Tensor& sums, int64_t in_features) {
  tandem::check_cpu("int8_linear", packed, sums);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.is_contiguous(),
              "int8_linear: the weight must be int8_pack's int8 [panels, in * 16] tensor");
  TORCH_CHECK(packed.size(1) == padded(in_features, kGroup) * kPanel,
              "int8_linear: the packed weight holds ", packed.size(1) / kPanel,
              " padded inputs, the rows have ", in_features);
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.dim() == 1 && sums.is_contiguous() &&
                  padded(sums.size(0), kPanel) / kPanel == packed.size(0),
              "int8_linear: weight_sums must be int32 [out] for the packed weight's ",
              packed.size(0), " panels");
}

}  // namespace

std::vector<int64_t> int8_linear_isas() { return isas_built(); }

bool int8_holds(const at::Tensor& packed, const at::Tensor& weight_sums,
                const at::Tensor& weight_scales, int64_t out, int64_t in) {
  return packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.is_contiguous() &&
         packed.size(0) == padded(out, kPanel) / kPanel &&
         packed.size(1) == padded(in, kGroup) * kPanel && weight_sums.scalar_type() == at::kInt &&
         weight_sums.is_contiguous() && weight_sums.numel() == out &&
         weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous() &&
         weight_scales.numel() == out;
}

at::Tensor int8_pack(const at::Tensor& qweight) {
  tandem::check_cpu("int8_pack", qweight);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2,
              "int8_pack takes an int8 [out, in] weight, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  const at::Tensor w = qweight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), kp = padded(k, kGroup);
  const int64_t panels = padded(n, kPanel) / kPanel;
  at::Tensor packed = at::zeros({panels, kp * kPanel}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  for (int64_t out = 0; out < n; ++out) {
    int8_t* panel = dst + (out / kPanel) * kp * kPanel;
    const int64_t lane = out % kPanel;
    for (int64_t i = 0; i < k; ++i)
      panel[(i / kGroup) * kPanel * kGroup + lane * kGroup + i % kGroup] = src[out * k + i];
  }
  return packed;
}

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  tandem::check_cpu("int8_quantize_rows", x);
  TORCH_CHECK(x.dim() == 2, "int8_quantize_rows takes [rows, in], got ", x.sizes());
  const at::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), kp = padded(k, kGroup);
  at::Tensor q = at::zeros({m, kp}, rows.options().dtype(at::kChar));
  at::Tensor scales = at::empty({m}, rows.options().dtype(at::kFloat));
  int8_t* qs = q.data_ptr<int8_t>();
  float* ss = scales.data_ptr<float>();
  tandem::dispatch_float_types(rows.scalar_type(), "int8_quantize_rows", [&](auto zero) {
    using T = decltype(zero);
    const T* src = rows.data_ptr<T>();
    at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r)
        ss[r] = tandem::int8::quantize_row(src + r * k, k, qs + r * kp) / 127.f;
    });
  });
  return {q, scales};
}

at::Tensor int8_matmul_int32(const at::Tensor& xq, const at::Tensor& packed,
                             const at::Tensor& weight_sums, int64_t isa) {
  tandem::check_cpu("int8_matmul_int32", xq);
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.is_contiguous() &&
                  xq.size(1) % kGroup == 0,
              "int8_matmul_int32 takes int8_quantize_rows' int8 [rows, padded in]");
  check_weight(packed, weight_sums, xq.size(1));
  const int64_t m = xq.size(0), n = weight_sums.size(0);
  at::Tensor out = at::empty({m, n}, xq.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  for_each_block(xq, packed, weight_sums, isa,
                 [&](int64_t row, int64_t rows, int64_t first, int64_t count, const int32_t* acc) {
                   for (int64_t r = 0; r < rows; ++r)
                     std::memcpy(o + (row + r) * n + first, acc + r * kBlock,
                                 count * sizeof(int32_t));
                 });
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& weight_sums, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& bias, int64_t isa) {
  tandem::check_cpu("int8_linear", x, weight_scales);
  TORCH_CHECK(x.dim() == 2, "int8_linear takes [rows, in], got ", x.sizes());
  check_weight(packed, weight_sums, x.size(1));
  const int64_t m = x.size(0), n = weight_sums.size(0);
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.numel() == n &&
                  weight_scales.is_contiguous(),
              "int8_linear: weight_scales must be float32 [", n, "]");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "int8_linear: bias must have ", n, " values");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  int8_linear_into(x, packed, weight_sums, weight_scales,
                   bias32.defined() ? bias32.data_ptr<float>() : nullptr, isa, out);
  return out;
}

void int8_linear_into(const at::Tensor& x, const at::Tensor& packed,
                      const at::Tensor& weight_sums, const at::Tensor& weight_scales,
                      const float* bias, int64_t isa, at::Tensor& out) {
  const int64_t n = weight_sums.size(0);
  const auto [xq, x_scales] = int8_quantize_rows(x);
  const float* sx = x_scales.data_ptr<float>();
  const float* sw = weight_scales.data_ptr<float>();
  const float* b = bias;
  tandem::dispatch_float_types(x.scalar_type(), "int8_linear", [&](auto zero) {
    using T = decltype(zero);
    T* o = out.data_ptr<T>();
    for_each_block(xq, packed, weight_sums, isa, [&](int64_t row, int64_t rows, int64_t first,
                                                     int64_t count, const int32_t* acc) {
      for (int64_t r = 0; r < rows; ++r)
        tandem::int8::dequantize_row(acc + r * kBlock, count, sx[row + r], sw + first,
                                     b != nullptr ? b + first : nullptr, o + (row + r) * n + first);
    });
  });
}
