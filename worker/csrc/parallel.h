// Splitting a kernel's independent tasks between the step's threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tandem {

namespace detail {

// One thread's share of the tasks, [begin, end) packed in one word so that its owner
// (taking from the front) and a thief (taking from the back) claim with one CAS each.
struct alignas(64) Share {
  std::atomic<uint64_t> range;

  static uint64_t pack(int64_t begin, int64_t end) {
    return static_cast<uint64_t>(begin) | static_cast<uint64_t>(end) << 32;
  }
  // The first (front) or last (back) task left, if any.
  bool claim(bool front, int64_t* task) {
    uint64_t seen = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t begin = static_cast<int64_t>(seen & 0xFFFFFFFFu);
      const int64_t end = static_cast<int64_t>(seen >> 32);
      if (begin >= end) return false;
      const uint64_t left = front ? pack(begin + 1, end) : pack(begin, end - 1);
      if (range.compare_exchange_weak(seen, left, std::memory_order_relaxed)) {
        *task = front ? begin : end - 1;
        return true;
      }
    }
  }
};

}  // namespace detail

// How many threads parallel_steal runs `count` tasks on, and the first task of thread t's
// starting share (its share is [share_begin(t), share_begin(t + 1))): a caller can tell
// which tasks each thread will start on (bf16_gemm fetches their data ahead).
inline int64_t steal_threads(int64_t count) {
  return std::min<int64_t>(at::get_num_threads(), count);
}
inline int64_t share_begin(int64_t t, int64_t count, int64_t threads) { return t * count / threads; }

// Runs body(task, next) for every task in [0, count) on at::get_num_threads() threads:
// `next` is the task the same thread will most likely run after this one (-1 if none),
// for prefetching its data while `task` computes.
//
// Each thread starts on a contiguous share, as at::parallel_for's, front to back; one
// that finishes its own then takes the other shares' last tasks, back to front. The worker
// shares its cores with the engine, the API server and whatever else runs: with fixed
// shares, a thread that loses its core for a while holds its whole remaining share and
// the other waits at the region's end; here the other takes the rest of the share. Tasks
// of unequal cost (attention over contexts of different lengths) even out the same way.
// Which thread runs a task never changes its result.
template <typename Body>
void parallel_steal(int64_t count, const Body& body) {
  if (count <= 0) return;
  TORCH_CHECK(count < (int64_t{1} << 31), "parallel_steal: too many tasks, ", count);
  const int64_t threads = steal_threads(count);
  // On the stack for up to kStackShares threads: a one-row decode step makes ~150 of these
  // regions, and an aligned heap allocation each (with its free) was ~1% of the step.
  constexpr int64_t kStackShares = 16;
  detail::Share stack_shares[kStackShares];
  std::unique_ptr<detail::Share[]> heap_shares;
  detail::Share* shares = stack_shares;
  if (threads > kStackShares) {
    heap_shares.reset(new detail::Share[threads]);
    shares = heap_shares.get();
  }
  for (int64_t t = 0; t < threads; ++t)
    shares[t].range.store(detail::Share::pack(share_begin(t, count, threads),
                                              share_begin(t + 1, count, threads)),
                          std::memory_order_relaxed);
  // One index per thread (or, with one thread or inside a parallel region, all of them
  // on the calling thread).
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t own = first; own < last; ++own) {
      int64_t task;
      const int64_t own_end = share_begin(own + 1, count, threads);
      while (shares[own].claim(true, &task)) body(task, task + 1 < own_end ? task + 1 : -1);
      for (int64_t k = 1; k < threads; ++k) {
        const int64_t victim = (own + k) % threads;
        const int64_t victim_begin = share_begin(victim, count, threads);
        while (shares[victim].claim(false, &task))
          body(task, task - 1 >= victim_begin ? task - 1 : -1);
      }
    }
  });
}

}  // namespace tandem
