// RMSNorm rows in one pass, rounding where transformers rounds, so bfloat16 results equal
// its eager code's: llama style  out = T(w * T(x * r)),  gemma style  out = T(x * r * (1 + w)),
// r = 1 / sqrt(mean(x^2) + eps), arithmetic in float32. With `add`, x is first replaced by
// the residual sum T(x + add), which is also returned (the residual stream of a layer).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>

#include "simd.h"

namespace {

template <typename T>
void rms_norm_rows(const T* x_data, const T* add_data, const T* w, T* out_data, T* res_data,
                   int64_t rows, int64_t dim, float feps, bool gemma) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x_data + r * dim;
      T* dst = out_data + r * dim;
      if (add_data) {  // the residual sum, rounded to T as a separate add would
        const T* other = add_data + r * dim;
        T* res = res_data + r * dim;
        for (int64_t j = 0; j < dim; ++j)
          res[j] = static_cast<T>(static_cast<float>(src[j]) + static_cast<float>(other[j]));
        src = res;
      }
      float sum = 0.f;
      for (int64_t j = 0; j < dim; ++j) {
        const float v = static_cast<float>(src[j]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + feps);
      if (gemma) {
        for (int64_t j = 0; j < dim; ++j)
          dst[j] = static_cast<T>(static_cast<float>(src[j]) * inv * (1.f + static_cast<float>(w[j])));
      } else {
        for (int64_t j = 0; j < dim; ++j) {
          const T normed = static_cast<T>(static_cast<float>(src[j]) * inv);
          dst[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
        }
      }
    }
  });
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* add, const at::Tensor& weight,
                   at::Tensor& out, at::Tensor* residual, double eps, bool gemma) {
  const int64_t dim = x.size(-1);
  rms_norm_rows<T>(x.data_ptr<T>(), add ? add->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                   out.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr,
                   x.numel() / dim, dim, static_cast<float>(eps), gemma);
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  tandem::check_cpu("rms_norm", x, weight);
  TORCH_CHECK(x.is_contiguous(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "weight must be [hidden] matching x's last dim");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight dtypes differ");
}

void dispatch(const at::Tensor& x, const at::Tensor* add, const at::Tensor& weight,
              at::Tensor& out, at::Tensor* residual, double eps, bool gemma) {
  tandem::dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, add, weight, out, residual, eps, gemma);
  });
}

}  // namespace

void rms_norm_bf16(const c10::BFloat16* x, const c10::BFloat16* add, const c10::BFloat16* weight,
                   c10::BFloat16* out, c10::BFloat16* residual, int64_t rows, int64_t dim,
                   double eps, bool gemma) {
  rms_norm_rows(x, add, weight, out, residual, rows, dim, static_cast<float>(eps), gemma);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  check(x, weight);
  auto out = at::empty_like(x);
  dispatch(x, nullptr, weight, out, nullptr, eps, gemma);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& add,
                                                const at::Tensor& weight, double eps, bool gemma) {
  check(x, weight);
  tandem::check_cpu("add_rms_norm", add);
  TORCH_CHECK(add.is_contiguous() && add.sizes() == x.sizes() &&
                  add.scalar_type() == x.scalar_type(),
              "add must be contiguous and shaped like x");
  auto residual = at::empty_like(x);
  auto out = at::empty_like(x);
  dispatch(x, &add, weight, out, &residual, eps, gemma);
  return {residual, out};
}
