// tandem::parallel_steal with tasks that only wait, for its unit test
// (tests/unit/test_parallel_steal.py): the kernels' results cannot show whether a task ran
// twice (most write the same values again) or which thread took it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include "kernels.h"
#include "parallel.h"

at::Tensor parallel_steal_trace(const at::Tensor& costs_us) {
  TORCH_CHECK(costs_us.dim() == 1 && costs_us.scalar_type() == at::kLong && costs_us.is_contiguous(),
              "parallel_steal_trace: costs_us is a contiguous int64 [tasks]");
  const int64_t count = costs_us.size(0);
  const int64_t* cost = costs_us.data_ptr<int64_t>();
  std::unique_ptr<std::atomic<int64_t>[]> runs(new std::atomic<int64_t>[count]);
  for (int64_t t = 0; t < count; ++t) runs[t].store(0);
  at::Tensor trace = at::full({count, 2}, -1, costs_us.options());
  int64_t* out = trace.data_ptr<int64_t>();
  tandem::parallel_steal(count, [&](int64_t task, int64_t) {
    runs[task].fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(cost[task]);
    while (std::chrono::steady_clock::now() < until) {
    }
    out[task * 2 + 1] = at::get_thread_num();
  });
  for (int64_t t = 0; t < count; ++t) out[t * 2] = runs[t].load();
  return trace;
}
