// CUDA kernels of topk (twins of topk_cpu.cpp). The order is the CPU's strict
// order (NaN first, then larger values, then the lower index), so ties and NaNs
// give the same indices. One block per row picks the k entries one at a time:
// pick j is the first entry in the order among those after pick j - 1, a block
// reduction with no scratch memory (O(k n / threads) per row; topk serves the
// router, where k and n are small).
#include <algorithm>

#include "ops/common/cuda_helpers.cuh"
#include "ops/topk/topk_kernels.h"

namespace moetrain::cuda {

namespace {

constexpr unsigned kMaxRowBlocks = 1u << 20;

template <class T>
__global__ void topk_forward_kernel(T* values, int64_t* indices, const T* x, int64_t rows, int64_t n, int64_t k) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    Ranked<A> prev{A(0), -1};
    for (int64_t j = 0; j < k; ++j) {
      Ranked<A> best{A(0), -1};
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        Ranked<A> c{load(xr, i), i};
        if ((j == 0 || ranks_before(prev, c)) && ranks_before(c, best)) best = c;
      }
      prev = block_first(best);  // k <= n: a candidate is always left
      if (threadIdx.x == 0) {
        values[r * k + j] = xr[prev.idx];
        indices[r * k + j] = prev.idx;
      }
    }
  }
}

template <class T>
__global__ void gather_last_kernel(T* out, const T* x, const int64_t* index, int64_t rows, int64_t n, int64_t k) {
  MT_GRID_LOOP(w, rows * k) {
    const int64_t r = w / k, i = index[w];
    store(out, w, i >= 0 && i < n ? load(x, r * n + i) : acc_t<T>(NAN));
  }
}

// One thread per row adds the row's k gradients in j order (a repeated index sums
// deterministically, no atomics); grad_x was zeroed.
template <class T>
__global__ void scatter_last_kernel(T* gx, const T* g, const int64_t* indices, int64_t rows, int64_t n, int64_t k) {
  MT_GRID_LOOP(r, rows) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = indices[r * k + j];
      if (i >= 0 && i < n) store(gx, r * n + i, load(gx, r * n + i) + load(g, r * k + j));
    }
  }
}

}  // namespace

void topk_forward(Tensor& values, Tensor& indices, const Tensor& x, int64_t k) {
  int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  if (rows == 0 || k == 0) return;
  int threads = static_cast<int>(std::clamp<int64_t>((n + 31) / 32 * 32, 32, kThreads));
  unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, kMaxRowBlocks));
  dispatch_float_cuda(x.dtype(), "topk", [&](auto tag) {
    using T = decltype(tag);
    launch("topk_forward_kernel", topk_forward_kernel<T>, blocks, threads, 0, stream_of(x), ptr<T>(values),
           ptr<int64_t>(indices), ptr<T>(x), rows, n, k);
  });
}

void gather_last_forward(Tensor& out, const Tensor& x, const Tensor& index) {
  const int64_t k = index.size(-1), n = x.size(-1), rows = index.numel() / std::max<int64_t>(k, 1);
  if (rows * k == 0) return;
  dispatch_float_cuda(x.dtype(), "gather_last", [&](auto tag) {
    using T = decltype(tag);
    launch("gather_last_kernel", gather_last_kernel<T>, blocks_for(rows * k), kThreads, 0, stream_of(x), ptr<T>(out),
           ptr<T>(x), ptr<int64_t>(index), rows, n, k);
  });
}

void scatter_last(Tensor& grad_x, const Tensor& grad, const Tensor& indices) {
  int64_t k = grad.size(-1), n = grad_x.size(-1), rows = grad_x.numel() / std::max<int64_t>(n, 1);
  cudaStream_t s = stream_of(grad_x);
  MT_CUDA_CHECK(cudaMemsetAsync(grad_x.raw_data(), 0, static_cast<size_t>(grad_x.nbytes()), s));
  if (rows * k == 0) return;
  dispatch_float_cuda(grad.dtype(), "scatter_last", [&](auto tag) {
    using T = decltype(tag);
    launch("scatter_last_kernel", scatter_last_kernel<T>, blocks_for(rows), kThreads, 0, s, ptr<T>(grad_x),
           ptr<T>(grad), ptr<int64_t>(indices), rows, n, k);
  });
}

}  // namespace moetrain::cuda
