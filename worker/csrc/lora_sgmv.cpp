// LoRA adapters' deltas for a step's rows in one call (Punica's SGMV: segments of rows,
// each with its own adapter): y[row] += scale_g * B_g (A_g x[row]) for every row of
// group g. One call per projection whatever the number of adapters, so a step of eight
// adapters costs the Python side what a step of one does.
//
// Rows go in blocks of four of one group: t = A x (each row of A read once for the four),
// then the delta as B^T's rows weighted by t, 16 outputs at a time in registers, over the
// blocks of B^T that are not zero only (a fused q/k/v projection's B is block-diagonal:
// two thirds zeros); y = T(float(y) + delta * scale), as PEFT adds
// lora_B(lora_A(x)) * scaling to the base output. All in float32.

#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <vector>

using tandem::check_cpu;
using tandem::dispatch_float_types;

// Fused multiply-adds here (the build turns contraction off for the kernels that must
// round as PyTorch does; an adapter's delta has no such reference: PEFT's own matmuls use
// them).
#pragma GCC optimize("fp-contract=fast")

namespace {

// 16 floats in one vector: gcc lowers it to one AVX-512 register, two AVX2 ones or scalar
// code, so the one source serves every build level.
using Vec = float __attribute__((vector_size(64)));
constexpr int64_t kWidth = 16;
constexpr int64_t kRowBlock = 4;  // rows sharing each load of A and B^T

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum_lanes(Vec v) {
  float s = 0.f;
  for (int64_t i = 0; i < kWidth; ++i) s += v[i];
  return s;
}

// One group's factors: A [r, in], B^T [r, out], and the blocks of B^T that are not zero
// (a fused projection's parts: ranks [r_lo, r_hi) write outputs [o_lo, o_hi) only).
struct Factors {
  const float* a;
  const float* bt;
  int64_t rank;
  std::vector<std::array<int64_t, 4>> blocks;
  float scale;
};

template <typename T>
void block_rows(T* y, int64_t y_stride, const T* x, int64_t x_stride, const int64_t* rows,
                int64_t count, const Factors& f, int64_t in, int64_t out) {
  thread_local std::vector<float> x_rows, t_rows;  // [kRowBlock, in], [kRowBlock, rank]
  x_rows.resize(kRowBlock * in);
  t_rows.resize(kRowBlock * std::max<int64_t>(f.rank, 1));
  const auto xf = [&](int64_t i) { return x_rows.data() + i * in; };
  const auto t = [&](int64_t i) { return t_rows.data() + i * f.rank; };
  // A short block is padded with zero rows: every loop below runs kRowBlock rows, so the
  // accumulators stay in registers (only the block's own rows are written back).
  for (int64_t i = 0; i < kRowBlock; ++i)
    for (int64_t k = 0; k < in; ++k)
      xf(i)[k] = i < count ? static_cast<float>(x[rows[i] * x_stride + k]) : 0.f;
  const int64_t in_vec = in / kWidth * kWidth;
  for (int64_t j = 0; j < f.rank; ++j) {  // t = A x, each A row read once for the block
    const float* aj = f.a + j * in;
    Vec acc[kRowBlock] = {};
    for (int64_t k = 0; k < in_vec; k += kWidth) {
      const Vec av = load(aj + k);
      for (int64_t i = 0; i < kRowBlock; ++i) acc[i] += av * load(xf(i) + k);
    }
    for (int64_t i = 0; i < kRowBlock; ++i) {
      float s = sum_lanes(acc[i]);
      for (int64_t k = in_vec; k < in; ++k) s += aj[k] * xf(i)[k];
      t(i)[j] = s;
    }
  }
  for (const auto& [r_lo, r_hi, o_lo, o_hi] : f.blocks) {  // y += scale * B t, block by block
    int64_t o = o_lo;
    for (; o + kWidth <= o_hi; o += kWidth) {
      Vec acc[kRowBlock] = {};
      for (int64_t j = r_lo; j < r_hi; ++j) {
        const Vec bv = load(f.bt + j * out + o);
        for (int64_t i = 0; i < kRowBlock; ++i) acc[i] += bv * t(i)[j];
      }
      for (int64_t i = 0; i < count; ++i) {
        T* yr = y + rows[i] * y_stride + o;
        for (int64_t l = 0; l < kWidth; ++l)
          yr[l] = static_cast<T>(static_cast<float>(yr[l]) + acc[i][l] * f.scale);
      }
    }
    for (; o < o_hi; ++o) {
      for (int64_t i = 0; i < count; ++i) {
        float d = 0.f;
        for (int64_t j = r_lo; j < r_hi; ++j) d += f.bt[j * out + o] * t(i)[j];
        T* yr = y + rows[i] * y_stride + o;
        *yr = static_cast<T>(static_cast<float>(*yr) + d * f.scale);
      }
    }
  }
}

template <typename T>
void sgmv_rows(T* y, int64_t y_stride, const T* x, int64_t x_stride, const int64_t* rows,
               const int64_t* starts, const std::vector<Factors>& groups, int64_t in,
               int64_t out) {
  // Tasks: blocks of up to kRowBlock rows of one group.
  std::vector<std::array<int64_t, 3>> tasks;  // group, first row index, rows
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (int64_t i = starts[g]; i < starts[g + 1]; i += kRowBlock)
      tasks.push_back({g, i, std::min(kRowBlock, starts[g + 1] - i)});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const auto [g, first, count] = tasks[task];
      block_rows(y, y_stride, x, x_stride, rows + first, count, groups[g], in, out);
    }
  });
}

}  // namespace

void lora_sgmv_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                const at::Tensor& group_starts, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& bt, const std::vector<at::Tensor>& blocks,
                const std::vector<double>& scales) {
  check_cpu("lora_sgmv_", y, x, rows, group_starts);
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0),
              "y [n, out] and x [n, in] must have the same rows");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "y and x rows must be contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "y and x must share a dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  group_starts.scalar_type() == at::kLong && group_starts.is_contiguous(),
              "rows and group_starts must be contiguous int64");
  const auto num_groups = static_cast<int64_t>(a.size());
  TORCH_CHECK(static_cast<int64_t>(bt.size()) == num_groups &&
                  static_cast<int64_t>(blocks.size()) == num_groups &&
                  static_cast<int64_t>(scales.size()) == num_groups &&
                  group_starts.numel() == num_groups + 1,
              "one A, one B^T, one block list, one scale and one start per group (and the end)");
  const int64_t in = x.size(1), out = y.size(1), n = y.size(0);
  const int64_t* starts = group_starts.data_ptr<int64_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_groups] == rows.numel(), "groups must cover rows");
  std::vector<Factors> groups;
  for (int64_t g = 0; g < num_groups; ++g) {
    const at::Tensor& ag = a[g];
    const at::Tensor& bg = bt[g];
    const at::Tensor& kg = blocks[g];
    check_cpu("lora_sgmv_", ag, bg, kg);
    TORCH_CHECK(ag.scalar_type() == at::kFloat && bg.scalar_type() == at::kFloat &&
                    ag.is_contiguous() && bg.is_contiguous(),
                "A and B^T must be contiguous float32");
    TORCH_CHECK(ag.dim() == 2 && bg.dim() == 2 && ag.size(1) == in && bg.size(1) == out &&
                    ag.size(0) == bg.size(0),
                "group ", g, ": A must be [r, in] and B^T [r, out]");
    TORCH_CHECK(kg.scalar_type() == at::kLong && kg.is_contiguous() && kg.dim() == 2 &&
                    kg.size(1) == 4,
                "group ", g, ": blocks must be int64 [k, 4] (r_lo, r_hi, o_lo, o_hi)");
    TORCH_CHECK(starts[g] <= starts[g + 1], "group starts must not decrease");
    Factors f{ag.data_ptr<float>(), bg.data_ptr<float>(), ag.size(0), {},
              static_cast<float>(scales[g])};
    const int64_t* kb = kg.data_ptr<int64_t>();
    for (int64_t k = 0; k < kg.size(0); ++k) {
      const int64_t r_lo = kb[4 * k], r_hi = kb[4 * k + 1], o_lo = kb[4 * k + 2],
                    o_hi = kb[4 * k + 3];
      TORCH_CHECK(0 <= r_lo && r_lo <= r_hi && r_hi <= f.rank && 0 <= o_lo && o_lo <= o_hi &&
                      o_hi <= out,
                  "group ", g, ": block ", k, " is out of A's ranks or y's outputs");
      f.blocks.push_back({r_lo, r_hi, o_lo, o_hi});
    }
    for (int64_t i = starts[g]; i < starts[g + 1]; ++i)
      TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < n, "row ", row_ids[i], " is out of range");
    groups.push_back(std::move(f));
  }
  dispatch_float_types(y.scalar_type(), "lora_sgmv_", [&](auto tag) {
    using T = decltype(tag);
    sgmv_rows(y.data_ptr<T>(), y.stride(0), x.data_ptr<T>(), x.stride(0), row_ids, starts,
              groups, in, out);
  });
}
