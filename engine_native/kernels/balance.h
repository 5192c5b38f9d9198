// Handing out work items of unequal cost to the threads in contiguous ranges of about equal total cost.
//
// at::parallel_for splits [0, n) into ranges of equal count. The attention kernels' items cost in
// proportion to a context length (a decode sequence's, or a prefill row tile's causal span), and on a
// load of mixed prompt lengths one thread got 1.6x the other's share of the decode attention and then
// waited at the barrier for it (perf, 2-core AMX host, 64 prompts of 51-973 tokens). Each item is
// still computed whole by one thread exactly as before, so results do not change, only who computes
// what. Dynamic scheduling was tried and lost: ~400 parallel regions a step cannot pay for a shared
// counter each.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace sluice {

// Calls fn(begin, end) once per thread, in parallel, the ranges covering [0, n) in order; cost(i) >= 0 is
// item i's relative cost. Each range ends at the item boundary nearest its share of the total.
template <typename Cost, typename Fn>
void parallel_for_by_cost(int64_t n, const Cost& cost, const Fn& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  std::vector<int64_t> prefix(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  const int64_t total = prefix[n];
  std::vector<int64_t> bounds(static_cast<size_t>(threads + 1), 0);
  bounds[threads] = n;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t target = total * t / threads;
    int64_t i = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
    if (i > 0 && target - prefix[i - 1] < prefix[i] - target) --i;  // the nearer boundary
    bounds[t] = std::clamp<int64_t>(i, bounds[t - 1], n);
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (bounds[t] < bounds[t + 1]) fn(bounds[t], bounds[t + 1]);
  });
}

}  // namespace sluice
