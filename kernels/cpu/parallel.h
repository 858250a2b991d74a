// The split of a kernel's work over the threads of at::parallel_for, for tasks that differ in length (ragged
// requests): each thread takes the next task from a shared counter. Shared by paged attention and the state ops.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace hybrid_ops::cpu {

// Runs fn(i) for i in [0, n) on every thread, each taking the next index from a shared counter.
template <typename F>
void parallel_dynamic(int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

// As parallel_dynamic, calling fn(i, following): following is the index the thread takes after i (n: none), claimed
// before fn(i) runs so that fn can prefetch what it reads; only while more tasks remain than threads, so that no thread
// waits for a task another one holds (two tasks on two threads run side by side).
template <typename F>
void parallel_dynamic_ahead(int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, std::min<int64_t>(n, threads), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n;) {
      const int64_t following = n - next.load() > threads ? std::min<int64_t>(next++, n) : n;
      fn(i, following);
      i = following < n ? following : next++;
    }
  });
}

}  // namespace hybrid_ops::cpu
