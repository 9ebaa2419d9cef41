// The host's deterministic parallel_for. Work is split into contiguous static
// chunks, so for a fixed thread count every element is computed by the same code
// path and results are bitwise reproducible run to run. In core/ because core's
// own loops (fill_, copy_, random draws) use it; the thread count is backend/cpu's
// knob (backend/cpu/parallel.h: set_num_threads; num_threads is defined in
// backend/cpu/threads.cpp).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace moetrain::cpu {

// Threads used by our kernels and by OpenBLAS.
int num_threads();

// fn(begin, end) over [0, n) in at most num_threads() contiguous chunks of at
// least `grain` elements. Runs inline when nested or when the work is small.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
  int nt = num_threads();
  int64_t chunks = std::min<int64_t>(nt, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1 || omp_in_parallel()) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(chunks))
  {
    int64_t c = omp_get_thread_num(), nc = omp_get_num_threads();
    int64_t begin = n * c / nc, end = n * (c + 1) / nc;
    if (begin < end) fn(begin, end);
  }
}

}  // namespace moetrain::cpu
