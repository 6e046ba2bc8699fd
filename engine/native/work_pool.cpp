// parallel_chunks: the few-row kernels' threads, robust to a core being taken away.
//
// at::parallel_for (OpenMP) splits a range into one share per thread and ends at a barrier: when the OS
// runs something else on one of the two cores (in a served worker, Serve's ingress and proxy took ~5 ms of
// CPU per streamed token then), the whole step waits for the descheduled thread. Measured on the 2-core box:
// SmolLM2's batch-1 step 9.5 ms alone, 21 ms inside a serving worker.
//
// Here the range is cut into chunks claimed from one counter by the calling thread and the pool's helpers
// (at::get_num_threads() - 1 of them). A helper the OS has not run takes no chunk, and the caller never
// waits for it: it returns once every chunk is done and no helper still holds the job. Which thread
// computes a chunk changes no result (each kernel computes every output the same way on any thread).
//
// Between jobs a helper waits as the step it serves calls for (set_pool_yields, once per step):
//
//   prefill or mixed steps     ~0.5 ms of pause, then sleep on a condition variable (the next kernel of a
//                              step follows within microseconds; OpenMP's threads run the big GEMMs)
//   decode-only steps          a few us of pause, then sched_yield until kYieldFor after its last job,
//                              then sleep
//
// Yielding is for the served worker: the tokens' hops (ingress, proxy, client: ~3 ms of CPU per token at
// c = 1) run on the engine's two cores, and a helper that pauses between kernels holds its core while they
// wait for it, so they preempt the engine's threads mid-kernel instead; one that yields hands them the core
// in its idle gaps. Served SmolLM2 (bench.serve_path, one mode per run, runs alternated; the box is noisy):
//
//   helpers yield in             c = 1 ITL p50 (ms)           c = 8 tok/s           c = 8 TTFT p50 (s)
//   no step (pause: the old)     15.24 15.69 16.90 15.04      72.0 69.2 70.5 65.8   3.9 4.1 3.9 4.2
//   every step                   14.05 14.50                  66.2 62.5             4.4 4.7
//   decode-only steps (this)     13.86 14.99                  62.6 75.1             4.9 3.7
//
// Yielding in every step lost at c = 8: a helper that yields is still runnable and takes turns from the
// OpenMP threads of the prefill chunks. WINDSERVE_POOL_YIELD=0 (read once) keeps the pause in every step.
//
// A job is published by bumping `generation`; a helper joins it by raising `active` and then checking the
// generation again, and the caller closes the job (bumps the generation) before it waits for `active` to
// fall to 0, so a late helper never touches a finished job. One job at a time: a second caller (another
// thread) runs its range inline.
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

constexpr int kSpinRounds = 20000;  // ~0.5 ms of pause before a helper sleeps (prefill and mixed steps)
constexpr int kYieldingSpins = 200;  // decode-only steps: a few us of pause before a helper yields,
constexpr std::chrono::microseconds kYieldFor{2000};  // then sched_yield until this long after its last job
constexpr int kCallerSpins = 2000;  // a few us of pause before the caller yields, waiting for a helper

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

thread_local bool in_job = false;

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may outlive static destruction at exit
    return *pool;
  }

  void set_yields(bool yields) { yields_.store(yields && yield_allowed_, std::memory_order_relaxed); }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
    const int64_t num_chunks = (n + grain - 1) / grain;
    const int threads = at::get_num_threads();
    std::unique_lock<std::mutex> submit(submit_, std::try_to_lock);
    if (num_chunks <= 1 || threads <= 1 || in_job || !submit.owns_lock()) {
      f(0, n);
      return;
    }
    ensure_helpers(threads - 1);
    f_ = &f, n_ = n, grain_ = grain, num_chunks_ = num_chunks;
    next_.store(0), done_.store(0);
    {
      std::lock_guard<std::mutex> lock(sleep_);
      generation_.fetch_add(1);  // open: helpers may join
    }
    wake_.notify_all();
    in_job = true;
    work();
    in_job = false;
    wait_until([&] { return done_.load() >= num_chunks_; });  // chunks a helper claimed, still running
    generation_.fetch_add(1);  // closed: a helper joining from now on leaves at once
    wait_until([&] { return active_.load() == 0; });
  }

 private:
  // Spin a little, then yield the core: a helper the OS took away mid-chunk needs a core to finish it,
  // and on two cores the one spinning here may be the only one it can get.
  template <typename Done>
  static void wait_until(Done done) {
    for (int spin = 0; !done(); ++spin) {
      if (spin < kCallerSpins) relax();
      else std::this_thread::yield();
    }
  }

  void work() {
    for (int64_t chunk; (chunk = next_.fetch_add(1)) < num_chunks_;) {
      const int64_t first = chunk * grain_;
      (*f_)(first, std::min(n_, first + grain_));
      done_.fetch_add(1);
    }
  }

  void ensure_helpers(int count) {
    while (static_cast<int>(helpers_.size()) < count) {
      helpers_.emplace_back([this] { helper(); });
      helpers_.back().detach();
    }
  }

  void helper() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "windserve-pool");  // how `top -H` and bench.serve_threads name it
#endif
    in_job = true;  // a chunk's own parallel call runs inline
    uint64_t seen = generation_.load();
    while (true) {
      uint64_t now = generation_.load();
      const bool yields = yields_.load(std::memory_order_relaxed);
      for (int spin = 0; now == seen && spin < (yields ? kYieldingSpins : kSpinRounds); ++spin) {
        relax(), now = generation_.load();
      }
      if (yields && now == seen) {
        const auto until = std::chrono::steady_clock::now() + kYieldFor;
        while (now == seen && std::chrono::steady_clock::now() < until) {
          std::this_thread::yield(), now = generation_.load();
        }
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(sleep_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        now = generation_.load();
      }
      seen = now;
      active_.fetch_add(1);
      if (generation_.load() == now && (now & 1) == 1) work();  // odd: a job is open
      active_.fetch_sub(1);
    }
  }

  const bool yield_allowed_ = [] {
    const char* flag = std::getenv("WINDSERVE_POOL_YIELD");
    return flag == nullptr || std::string(flag) != "0";
  }();
  std::atomic<bool> yields_{false};
  std::mutex submit_, sleep_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  std::atomic<uint64_t> generation_{0};  // odd while a job is open
  std::atomic<int64_t> next_{0}, done_{0}, active_{0};
  const std::function<void(int64_t, int64_t)>* f_ = nullptr;
  int64_t n_ = 0, grain_ = 1, num_chunks_ = 0;
};

}  // namespace

namespace windserve {

void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  Pool::get().run(n, std::max<int64_t>(1, grain), f);
}

}  // namespace windserve

void set_pool_yields(bool yields) { Pool::get().set_yields(yields); }
