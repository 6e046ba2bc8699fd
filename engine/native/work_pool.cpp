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
#include <cstring>
#include <memory>
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
constexpr int64_t kMinGraceNs = 3000;  // a column job's caller waits at least this long before it steals

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

thread_local bool in_job = false;

// A column chunk's state (Job::state). A helper computes its chunk into scratch memory of its own and
// publishes it only if it can move the chunk from kOpen to kCommitting; the caller may instead move it to
// kStolen and compute it itself. So a helper that comes back late never writes the caller's output.
enum ChunkState : int { kOpen = 0, kCommitting = 1, kStolen = 2, kDone = 3 };

struct Job {
  int64_t n = 0, grain = 1, num_chunks = 0;
  std::atomic<int64_t> next{0}, done{0};
  // plain jobs: the caller's function, on its stack; run only for a claimed chunk, which the caller awaits
  const std::function<void(int64_t, int64_t)>* plain = nullptr;
  // column jobs: owned here (it keeps what it reads alive), so a helper may run it after the caller left
  windserve::ColumnsFn columns;
  float* y = nullptr;  // the caller's output: written by a helper only between kCommitting and kDone
  int64_t rows = 0, y_stride = 0;
  std::unique_ptr<std::atomic<int>[]> state;

  int64_t first(int64_t chunk) const { return chunk * grain; }
  int64_t last(int64_t chunk) const { return std::min(n, first(chunk) + grain); }
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may outlive static destruction at exit
    return *pool;
  }

  void set_yields(bool yields) { yields_.store(yields && yield_allowed_, std::memory_order_relaxed); }
  void stall_next_helper_chunk(int64_t us) { stall_us_.store(us); }
  int64_t stolen_chunks() const { return stolen_.load(); }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
    const int64_t num_chunks = (n + grain - 1) / grain;
    std::unique_lock<std::mutex> submit(submit_, std::try_to_lock);
    if (num_chunks <= 1 || at::get_num_threads() <= 1 || in_job || !submit.owns_lock()) {
      f(0, n);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n = n, job->grain = grain, job->num_chunks = num_chunks, job->plain = &f;
    publish(job);
    in_job = true;
    for (int64_t chunk; (chunk = job->next.fetch_add(1)) < num_chunks;) {
      f(job->first(chunk), job->last(chunk));
      job->done.fetch_add(1);
    }
    in_job = false;
    wait_until([&] { return job->done.load() >= num_chunks; });  // chunks a helper claimed, still running
    close();
  }

  void run_columns(int64_t n, int64_t grain, int64_t rows, float* y, int64_t y_stride, windserve::ColumnsFn f) {
    const int64_t num_chunks = (n + grain - 1) / grain;
    std::unique_lock<std::mutex> submit(submit_, std::try_to_lock);
    if (num_chunks <= 1 || at::get_num_threads() <= 1 || in_job || !submit.owns_lock()) {
      f(0, n, y, y_stride, 0);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n = n, job->grain = grain, job->num_chunks = num_chunks, job->rows = rows, job->y = y;
    job->y_stride = y_stride, job->columns = std::move(f);
    job->state.reset(new std::atomic<int>[num_chunks]);
    for (int64_t c = 0; c < num_chunks; ++c) job->state[c].store(kOpen);
    publish(job);
    in_job = true;
    const int64_t began = now_ns();
    int64_t own = 0;
    for (int64_t chunk; (chunk = job->next.fetch_add(1)) < num_chunks; ++own) {
      job->columns(job->first(chunk), job->last(chunk), y, y_stride, 0);
      job->state[chunk].store(kDone);
    }
    // A helper's chunk still open after a few of our own chunks' time: its thread is likely off its core
    // (the OS ran something else there). Compute it here rather than wait for that thread to come back.
    const int64_t grace = std::max(kMinGraceNs, 3 * (now_ns() - began) / std::max<int64_t>(1, own));
    const int64_t deadline = now_ns() + grace;
    for (int64_t c = 0; c < num_chunks; ++c) {
      for (int spin = 0; job->state[c].load() == kOpen && now_ns() < deadline; ++spin) relax();
      int open = kOpen;
      if (job->state[c].compare_exchange_strong(open, kStolen)) {
        job->columns(job->first(c), job->last(c), y, y_stride, 0);
        job->state[c].store(kDone);
        stolen_.fetch_add(1);
      }
      wait_until([&] { return job->state[c].load() == kDone; });  // a helper publishing it: a copy's time
    }
    in_job = false;
    close();
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

  void publish(const std::shared_ptr<Job>& job) {
    ensure_helpers(at::get_num_threads() - 1);
    {
      std::lock_guard<std::mutex> lock(sleep_);
      current_ = job;
      generation_.fetch_add(1);  // odd: open, helpers may join
    }
    wake_.notify_all();
  }

  void close() {
    std::lock_guard<std::mutex> lock(sleep_);
    generation_.fetch_add(1);  // even: a helper waking from now on finds no job
    current_.reset();  // a helper still in it holds its own reference
  }

  // A helper's share of a job: claimed chunks, until none is left.
  void work(Job& job) {
    for (int64_t chunk; (chunk = job.next.fetch_add(1)) < job.num_chunks;) {
      const int64_t first = job.first(chunk), last = job.last(chunk);
      if (job.plain != nullptr) {
        (*job.plain)(first, last);
        job.done.fetch_add(1);
        continue;
      }
      if (const int64_t stall = stall_us_.exchange(0); stall > 0) {  // tests: a helper taken off its core
        std::this_thread::sleep_for(std::chrono::microseconds(stall));
      }
      const int64_t width = last - first;
      thread_local std::vector<float> scratch;
      scratch.resize(static_cast<size_t>(job.rows * width));
      job.columns(first, last, scratch.data(), width, first);
      int open = kOpen;
      if (!job.state[chunk].compare_exchange_strong(open, kCommitting)) continue;  // the caller took it
      for (int64_t t = 0; t < job.rows; ++t) {
        std::memcpy(job.y + t * job.y_stride + first, scratch.data() + t * width, width * sizeof(float));
      }
      job.state[chunk].store(kDone);
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
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(sleep_);
        if (now == seen) {
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          now = generation_.load();
        }
        if (generation_.load() == now && (now & 1) == 1) job = current_;  // odd: a job is open
      }
      seen = now;
      if (job) work(*job);
    }
  }

  const bool yield_allowed_ = [] {
    const char* flag = std::getenv("WINDSERVE_POOL_YIELD");
    return flag == nullptr || std::string(flag) != "0";
  }();
  std::atomic<bool> yields_{false};
  std::atomic<int64_t> stall_us_{0}, stolen_{0};
  std::mutex submit_, sleep_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  std::atomic<uint64_t> generation_{0};  // odd while a job is open
  std::shared_ptr<Job> current_;  // under sleep_
};

}  // namespace

namespace windserve {

void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  Pool::get().run(n, std::max<int64_t>(1, grain), f);
}

void parallel_columns(int64_t n, int64_t grain, int64_t rows, float* y, int64_t y_stride, ColumnsFn f) {
  Pool::get().run_columns(n, std::max<int64_t>(1, grain), rows, y, y_stride, std::move(f));
}

}  // namespace windserve

void set_pool_yields(bool yields) { Pool::get().set_yields(yields); }

void stall_next_pool_chunk(int64_t microseconds) { Pool::get().stall_next_helper_chunk(microseconds); }

int64_t pool_stolen_chunks() { return Pool::get().stolen_chunks(); }
