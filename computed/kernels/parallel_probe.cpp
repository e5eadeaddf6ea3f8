// kvcache::parallel_visits(n, grain) -> (visits, threads): how the kernels' parallel loop
// (parallel.h) ran [0, n) with that grain. visits (n,) int64: how many times each index
// ran (every one exactly once, whatever the threads did); threads: how many distinct
// threads ran chunks. For tests (tests/computed/test_kernel_pool.py), not for the model.

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

namespace {

std::tuple<at::Tensor, int64_t> parallel_visits(int64_t n, int64_t grain) {
  TORCH_CHECK(n >= 0 && grain >= 1, "parallel_visits takes n >= 0 and grain >= 1");
  at::Tensor visits = at::zeros({n}, at::kLong);
  auto* counts = reinterpret_cast<std::atomic<int64_t>*>(visits.data_ptr<int64_t>());
  std::mutex mutex;
  std::set<std::thread::id> threads;
  kvcache_par::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      threads.insert(std::this_thread::get_id());
    }
    for (int64_t i = lo; i < hi; ++i) {
      counts[i].fetch_add(1, std::memory_order_relaxed);
      // a little work an index, so that a helper has time to join a long range
      volatile double x = 1.0;
      for (int k = 0; k < 200; ++k) x = x * 1.000001 + 1e-9;
    }
  });
  return {visits, static_cast<int64_t>(threads.size())};
}

}  // namespace

// No tensor argument to dispatch on: one kernel for every key.
TORCH_LIBRARY_FRAGMENT(kvcache, m) { m.def("parallel_visits(int n, int grain) -> (Tensor, int)", parallel_visits); }
