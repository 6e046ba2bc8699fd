// parallel_chunks: the few-row kernels' threads, robust to a core being taken away.
//
// at::parallel_for (OpenMP) splits a range into one share per thread and ends at a barrier: when the OS
// runs something else on one of the two cores (in a served worker, Serve's ingress and proxy take ~5 ms of
// CPU per streamed token), the whole step waits for the descheduled thread. Measured on the 2-core box:
// SmolLM2's batch-1 step 9.5 ms alone, 21 ms inside a serving worker.
//
// Here the range is cut into chunks claimed from one counter by the calling thread and the pool's helpers
// (at::get_num_threads() - 1 of them). A helper the OS has not run takes no chunk, and the caller never
// waits for it: it returns once every chunk is done and no helper still holds the job. Which thread
// computes a chunk changes no result (each kernel computes every output the same way on any thread).
//
// A helper spins for a short while after its last job (the next kernel of a step follows within
// microseconds), then sleeps on a condition variable. A job is published by bumping `generation`; a helper
// joins it by raising `active` and then checking the generation again, and the caller closes the job
// (bumps the generation) before it waits for `active` to fall to 0, so a late helper never touches a
// finished job. One job at a time: a second caller (another thread) runs its range inline.
#include <ATen/Parallel.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

constexpr int kSpinRounds = 20000;  // ~50-100 us of pause before a helper sleeps
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
    in_job = true;  // a chunk's own parallel call runs inline
    uint64_t seen = generation_.load();
    while (true) {
      uint64_t now = generation_.load();
      for (int spin = 0; now == seen && spin < kSpinRounds; ++spin) relax(), now = generation_.load();
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
