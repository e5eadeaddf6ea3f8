// The kernels' parallel loops: work sharing that a descheduled thread cannot stall.
//
// Why: at::parallel_for runs on torch's OpenMP team, and a region ends only when every
// thread of the team has reached its barrier. Where the daemon shares its cores (the event
// loop, the gateway, a load generator: 2 cores under `python -m bench --only serving`), the
// OS deschedules one of the two threads often, and then each region waits for it: beside
// a process busy 1 ms of every 2, a 32 x 16-token prefill took 20.1 ms on the team's 2
// threads against 19.3 on 1 (`python -m bench.kernel_pool`, docs/kernels.md; 16.6 here,
// decode steps 0.70x the team's). Here the calling thread runs chunks of the range itself,
// helpers run chunks while they are on a core, and the caller waits only for chunks a
// helper has already taken: a helper that is not running costs nothing, one descheduled
// mid-chunk at most that chunk.
//
// Invariants:
// - Every index of [begin, end) runs exactly once, on the caller or a helper, before
//   `parallel_for` returns (its effects visible to the caller: release/acquire on `done`).
// - A chunk runs only after a compare-and-swap on the ticket word claimed it. The word
//   holds the job's generation, its chunk count and the next chunk, so a helper late from
//   an earlier job can never claim one of a later job, and a job's fields stay unchanged
//   while any of its claimed chunks runs (the caller publishes the next job only once
//   every chunk is done).
// - A call from inside a chunk (nested) runs inline; so does one from a child process
//   after fork (the helpers are the parent's).
// - Participants: torch's intra-op thread count (at::get_num_threads()), the caller and
//   that many minus one helpers, made on first use and kept for the process's life.
// - COMPUTED_KERNEL_POOL=omp (read once) sends every loop to at::parallel_for instead.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvcache_par {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool();  // never destroyed: helpers may still wait at exit
    return *pool;
  }

  static bool& in_region() {
    static thread_local bool flag = false;
    return flag;
  }

  bool uses_omp() const { return omp_; }

  template <class F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t threads = at::get_num_threads();
    if (threads <= 1 || n <= std::max<int64_t>(grain, 1) || in_region() || forked()) {
      Inline guard;
      f(begin, end);
      return;
    }
    // Several chunks a thread, so that the caller can take over what a slow helper leaves.
    const int64_t chunk = std::max<int64_t>({grain, 1, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread)});
    const int64_t chunks = (n + chunk - 1) / chunk;
    if (chunks <= 1) {
      Inline guard;
      f(begin, end);
      return;
    }
    std::lock_guard<std::mutex> one_job(job_mutex_);  // callers from several threads take turns
    ensure_helpers(threads - 1);
    job_.begin = begin;
    job_.end = end;
    job_.chunk = chunk;
    job_.fn = &f;
    job_.call = [](const void* fn, int64_t lo, int64_t hi) { (*static_cast<const F*>(fn))(lo, hi); };
    done_.store(0, std::memory_order_relaxed);
    allowed_.store(threads - 1);  // seq_cst, before the ticket: a helper reads it after
    generation_ = (generation_ + 1) & kGenMask;
    ticket_.store(pack(generation_, chunks, 0));  // seq_cst: read against `sleepers_` (Dekker)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    uint64_t claimed;
    while (claim(generation_, &claimed)) run_chunk(claimed);
    // Every chunk is claimed: wait for the helpers' to finish. Spin briefly (they are
    // short), then yield: on a busy machine the helper holding the last chunk may need
    // this core to finish it.
    for (int64_t spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < kSpinsBeforeYield) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    if (error_) {
      std::exception_ptr error = error_;
      error_ = nullptr;
      std::rethrow_exception(error);
    }
  }

 private:
  static constexpr int64_t kChunksPerThread = 4;
  static constexpr int64_t kSpinsBeforeYield = 1000;  // ~20-40 us of pause instructions
  static constexpr int64_t kHelperSpins = 2000;       // a helper's wait for the next region before it sleeps
  // ticket word: generation (24 bits) | chunk count (20 bits) | next chunk (20 bits)
  static constexpr uint64_t kIndexBits = 20, kIndexMask = (1ull << kIndexBits) - 1, kGenMask = (1ull << 24) - 1;

  struct Job {
    int64_t begin = 0, end = 0, chunk = 1;
    const void* fn = nullptr;
    void (*call)(const void*, int64_t, int64_t) = nullptr;
  };

  struct Inline {  // marks a chunk's thread as inside a region (nested calls run inline)
    bool saved;
    Inline() : saved(in_region()) { in_region() = true; }
    ~Inline() { in_region() = saved; }
  };

  Pool() {
    const char* mode = std::getenv("COMPUTED_KERNEL_POOL");
    omp_ = mode != nullptr && std::strcmp(mode, "omp") == 0;
    pthread_atfork(nullptr, nullptr, [] { forked() = true; });  // the child has no helpers
  }

  static bool& forked() {
    static bool flag = false;
    return flag;
  }

  static uint64_t pack(uint64_t gen, uint64_t chunks, uint64_t next) {
    return (gen << (2 * kIndexBits)) | (chunks << kIndexBits) | next;
  }

  // Claim the next chunk of job `gen`; false once it has none left (or is not current).
  bool claim(uint64_t gen, uint64_t* index) {
    uint64_t word = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = word & kIndexMask, chunks = (word >> kIndexBits) & kIndexMask;
      if ((word >> (2 * kIndexBits)) != gen || next >= chunks) return false;
      if (ticket_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        *index = next;
        return true;
      }
    }
  }

  void run_chunk(uint64_t index) {
    const int64_t lo = job_.begin + static_cast<int64_t>(index) * job_.chunk;
    const int64_t hi = std::min(job_.end, lo + job_.chunk);
    try {
      Inline guard;
      job_.call(job_.fn, lo, hi);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_release);
  }

  void ensure_helpers(int64_t wanted) {
    while (static_cast<int64_t>(num_helpers_) < wanted) {
      const int64_t index = static_cast<int64_t>(num_helpers_);
      std::thread([this, index] { helper(index); }).detach();
      ++num_helpers_;
    }
  }

  // Helper `index` (0-based) takes part in the jobs that allow more than `index` helpers.
  void helper(int64_t index) {
    uint64_t seen = 0;  // a helper made for the current job joins it
    for (;;) {
      uint64_t gen = ticket_.load(std::memory_order_acquire) >> (2 * kIndexBits);
      for (int64_t spins = 0; gen == seen && spins < kHelperSpins; ++spins) {
        cpu_relax();
        gen = ticket_.load(std::memory_order_acquire) >> (2 * kIndexBits);
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1);  // seq_cst: read against `ticket_` (Dekker)
        while ((gen = ticket_.load() >> (2 * kIndexBits)) == seen) wake_.wait(lock);
        sleepers_.fetch_sub(1);
      }
      seen = gen;
      if (index >= allowed_.load()) continue;  // torch's thread count is lower now
      uint64_t chunk;
      while (claim(gen, &chunk)) run_chunk(chunk);
    }
  }

  bool omp_ = false;
  std::mutex job_mutex_, sleep_mutex_, error_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> sleepers_{0};
  std::atomic<int64_t> allowed_{0};  // helpers the current job may use
  uint64_t generation_ = 0;
  size_t num_helpers_ = 0;
  Job job_;
  std::exception_ptr error_;
};

// at::parallel_for's contract: f(lo, hi) over chunks of [begin, end), at least `grain`
// indices each (the last may be shorter); inline when the range is one grain or less.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Pool& pool = Pool::instance();
  if (pool.uses_omp()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  pool.run(begin, end, grain, f);
}

inline bool in_parallel_region() { return Pool::in_region() || at::in_parallel_region(); }

// How many threads a loop may use (torch's intra-op count), 1 inside a loop's chunk.
inline int64_t num_threads() { return in_parallel_region() ? 1 : at::get_num_threads(); }

}  // namespace kvcache_par
