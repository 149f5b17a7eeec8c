// Shared-memory collectives between the TP ranks of one host (workers/shm_comm.py owns the
// segment layout). A rank copies its part into its slot, then publishes the step's sequence
// number in its flag; readers wait until every flag has reached that number.

#include <sched.h>
#include <time.h>

#include "common.h"

namespace {

constexpr int64_t SLEEP_AFTER_US = 200;
constexpr long SLEEP_NS = 20000;

inline int64_t now_us() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

template <typename T>
void shm_sum_impl(T* dst, const char* slots, int64_t slot_stride, int world, int64_t numel) {
  // Every rank adds the slots in rank order in float32: all ranks get bit-identical sums.
#pragma omp parallel for schedule(static) if (numel > 65536)
  for (int64_t i0 = 0; i0 < numel; i0 += 1024) {
    const int64_t i1 = i0 + 1024 < numel ? i0 + 1024 : numel;
    float acc[1024];
    const T* s0 = reinterpret_cast<const T*>(slots);
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) acc[i - i0] = load(s0, i);
    for (int r = 1; r < world; ++r) {
      const T* sr = reinterpret_cast<const T*>(slots + r * slot_stride);
#pragma omp simd
      for (int64_t i = i0; i < i1; ++i) acc[i - i0] += load(sr, i);
    }
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) store(dst, i, acc[i - i0]);
  }
}

}  // namespace

extern "C" {

void tandem_shm_post(int64_t* flag, int64_t seq, void* slot, const void* src, int64_t nbytes) {
  std::memcpy(slot, src, nbytes);
  __atomic_store_n(flag, seq, __ATOMIC_RELEASE);
}

// 1 once every rank's flag (flags[r * flag_stride]) is >= seq; 0 after ~budget_us without.
// Spins briefly (the peers are usually microseconds behind), then yields the core so a
// rank or the engine core sharing it can run, and past SLEEP_AFTER_US sleeps between looks:
// a peer that far behind has most likely lost its core to another process, and a sleeping
// rank frees its own core for it (TP=2 beside a busy process: 844 -> 881 tok/s, medians of 3;
// no change on an idle box, where peers are rarely that late).
int tandem_shm_wait(const int64_t* flags, int64_t flag_stride, int world, int64_t seq,
                    int64_t budget_us) {
  const int64_t start = now_us();
  for (int64_t spins = 0;; ++spins) {
    int ready = 0;
    for (int r = 0; r < world; ++r)
      ready += __atomic_load_n(flags + r * flag_stride, __ATOMIC_ACQUIRE) >= seq;
    if (ready == world) return 1;
    if ((spins & 63) == 0) {
      const int64_t waited = now_us() - start;
      if (waited > budget_us) return 0;
      if (waited > SLEEP_AFTER_US) {
        const timespec nap = {0, SLEEP_NS};
        nanosleep(&nap, nullptr);
      } else if (waited > 20) {
        sched_yield();
      }
    }
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

void tandem_shm_sum(int dtype, void* dst, const void* slots, int64_t slot_stride, int world,
                    int64_t numel) {
  const char* base = static_cast<const char*>(slots);
  if (dtype == 0)
    shm_sum_impl(static_cast<float*>(dst), base, slot_stride, world, numel);
  else
    shm_sum_impl(static_cast<uint16_t*>(dst), base, slot_stride, world, numel);
}


}  // extern "C"
