// Work distribution of the CPU drivers (fused step and encode/decode).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace qconf {

// Runs fn(begin, end, tid) over [0, n) in chunks that the threads take from a shared counter as
// they finish, instead of one fixed range per thread: on a shared machine one slowed thread
// would otherwise leave the others waiting at the end of the phase. Results never depend on
// which thread runs a chunk (the kernels' per-thread partials are combined with max).
template <class Fn>
void parallel_chunks(int64_t n, Fn&& fn) {
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || n == 1 || at::in_parallel_region()) {
    fn(int64_t{0}, n, static_cast<int32_t>(at::get_thread_num()));
    return;
  }
  // ~8 chunks per thread: small enough to even out, large enough to keep per-chunk setup rare
  const int64_t chunk = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int32_t tid = static_cast<int32_t>(at::get_thread_num());
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) fn(b, std::min(b + chunk, n), tid);
  });
}

}  // namespace qconf
