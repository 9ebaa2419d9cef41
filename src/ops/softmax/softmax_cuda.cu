// CUDA kernels of the softmax family (twins of softmax_cpu.cpp): one block per
// row, max-subtracted exponentials summed in acc_t<T> (f32 for f32 and bf16,
// f64 for f64). Cross-entropy runs the shared bodies of cross_entropy_simt.h: it
// reads bf16 logits as they are (f32 arithmetic, an f32 loss, a bf16 gradient
// rounded once), keeps lse in f64 like the CPU kernel and reduces the row losses
// in a fixed order (deterministic), entirely on the device: the loss and its
// incoming gradient never visit the host.
#include <algorithm>

#include "ops/common/cuda_helpers.cuh"
#include "ops/softmax/cross_entropy_simt.h"
#include "ops/softmax/softmax_kernels.h"

namespace moetrain::cuda {

namespace {

constexpr unsigned kMaxRowBlocks = 1u << 20;
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxRowBlocks)); }

template <class T> __device__ acc_t<T> row_max(const T* xr, int64_t n) {
  using A = acc_t<T>;
  A m = neg_inf<A>();
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = max(m, load(xr, j));
  return block_max(m);
}

template <class T> __global__ void softmax_forward_kernel(T* y, const T* x, int64_t rows, int64_t n, bool log) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A m = row_max(xr, n), s = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += exp_a(load(xr, j) - m);
    s = block_sum(s);
    if (log) {
      A log_s = log_a(s);
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) store(yr, j, (load(xr, j) - m) - log_s);
    } else {
      A inv = A(1) / s;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) store(yr, j, exp_a(load(xr, j) - m) * inv);
    }
  }
}

// softmax: dx = y (dy - Σ dy y);  log_softmax: dx = dy - e^y Σ dy.
template <class T>
__global__ void softmax_backward_kernel(T* dx, const T* dy, const T* y, int64_t rows, int64_t n, bool log) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * n;
    const T* gr = dy + r * n;
    T* xr = dx + r * n;
    A dot = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += log ? load(gr, j) : load(gr, j) * load(yr, j);
    dot = block_sum(dot);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A g = load(gr, j), yv = load(yr, j);
      store(xr, j, log ? g - exp_a(yv) * dot : yv * (g - dot));
    }
  }
}

// Cross-entropy: the bodies of ops/softmax/cross_entropy_simt.h (which the host
// tests run against the CPU op), one block of kThreads per row.
template <class T, class I>
__global__ void cross_entropy_rows_kernel(simt::CrossEntropyArgs<T, I> a) {
  extern __shared__ __align__(16) unsigned char ce_shared[];
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x)
    simt::cross_entropy_row(simt::DeviceBlock{static_cast<int>(blockDim.x)}, a, r,
                            reinterpret_cast<double*>(ce_shared));
}

constexpr int kTotalThreads = 256;  // a power of two (the body's tree)

// loss[0] = Σ_r row_loss[r] / divisor and counted[0], in a fixed order (one block).
template <class L, class I>
__global__ void cross_entropy_total_kernel(L* loss, double* counted, const double* row_loss, const I* targets,
                                           int64_t rows, int64_t ignore_index, bool mean) {
  __shared__ double partial[2 * kTotalThreads];
  simt::cross_entropy_total(simt::DeviceBlock{static_cast<int>(blockDim.x)}, loss, counted, row_loss, targets, rows,
                            ignore_index, mean, partial);
}

// scale = grad_loss / divisor, both read on the device (no host round trip).
template <class T, class I>
__global__ void cross_entropy_backward_kernel(simt::CrossEntropyArgs<T, I> a, const simt::acc_of_t<T>* grad_loss,
                                              const double* counted, bool mean) {
  const double scale = static_cast<double>(grad_loss[0]) / simt::cross_entropy_divisor(counted[0], mean);
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x)
    simt::cross_entropy_backward_row(simt::DeviceBlock{static_cast<int>(blockDim.x)}, a, r, scale);
}

struct RowsCols {
  int64_t rows, n;
};
RowsCols rows_cols(const Tensor& x) {
  int64_t n = x.size(-1);
  return {x.numel() / std::max<int64_t>(n, 1), n};
}

}  // namespace

void softmax_forward(Tensor& y, const Tensor& x, bool log) {
  auto [rows, n] = rows_cols(x);
  if (rows == 0 || n == 0) return;
  dispatch_float_cuda(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    launch("softmax_forward_kernel", softmax_forward_kernel<T>, row_blocks(rows), kThreads, 0, stream_of(x), ptr<T>(y),
           ptr<T>(x), rows, n, log);
  });
}

void softmax_backward(Tensor& grad_x, const Tensor& grad_y, const Tensor& y, bool log) {
  auto [rows, n] = rows_cols(y);
  if (rows == 0 || n == 0) return;
  dispatch_float_cuda(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    launch("softmax_backward_kernel", softmax_backward_kernel<T>, row_blocks(rows), kThreads, 0, stream_of(y),
           ptr<T>(grad_x), ptr<T>(grad_y), ptr<T>(y), rows, n, log);
  });
}

void cross_entropy_forward(Tensor& lse, Tensor& loss, Tensor& counted, const Tensor& logits, const Tensor& targets,
                           int64_t ignore_index, int64_t num_classes, bool mean) {
  auto [rows, v] = rows_cols(logits);
  Tensor row_loss = empty({rows}, DType::f64, logits.device());
  dispatch_float_cuda(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    using L = simt::acc_of_t<T>;
    dispatch_index(targets.dtype(), "cross_entropy", [&](auto itag) {
      using I = decltype(itag);
      cudaStream_t s = stream_of(logits);
      if (rows > 0) {
        simt::CrossEntropyArgs<T, I> a;
        a.logits = ptr<T>(logits);
        a.targets = ptr<I>(targets);
        a.lse = ptr<double>(lse);
        a.row_loss = ptr<double>(row_loss);
        a.rows = rows;
        a.v = v;
        a.num_classes = num_classes;
        a.ignore_index = ignore_index;
        const size_t bytes = static_cast<size_t>(simt::cross_entropy_shared_elements(kThreads)) * sizeof(double);
        launch_with_shared(cross_entropy_rows_kernel<T, I>, row_blocks(rows), kThreads, bytes, s,
                           "cross_entropy_rows_kernel", "a smaller block", a);
      }
      launch("cross_entropy_total_kernel", cross_entropy_total_kernel<L, I>, 1, kTotalThreads, 0, s, ptr<L>(loss),
             ptr<double>(counted), ptr<double>(row_loss), ptr<I>(targets), rows, ignore_index, mean);
    });
  });
}

void cross_entropy_backward(Tensor& grad_logits, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            const Tensor& grad_loss, const Tensor& counted, bool mean, int64_t ignore_index,
                            int64_t num_classes) {
  auto [rows, v] = rows_cols(logits);
  if (rows == 0 || v == 0) return;
  dispatch_float_cuda(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    using L = simt::acc_of_t<T>;
    dispatch_index(targets.dtype(), "cross_entropy_backward", [&](auto itag) {
      using I = decltype(itag);
      simt::CrossEntropyArgs<T, I> a;
      a.logits = ptr<T>(logits);
      a.targets = ptr<I>(targets);
      a.lse = ptr<double>(lse);  // read only by the backward body
      a.grad = ptr<T>(grad_logits);
      a.rows = rows;
      a.v = v;
      a.num_classes = num_classes;
      a.ignore_index = ignore_index;
      launch("cross_entropy_backward_kernel", cross_entropy_backward_kernel<T, I>, row_blocks(rows), kThreads, 0,
             stream_of(logits), a, ptr<L>(grad_loss), ptr<double>(counted), mean);
    });
  });
}

}  // namespace moetrain::cuda
