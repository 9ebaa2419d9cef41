// CUDA kernels of the softmax family (twins of softmax_cpu.cpp): one block per
// row, max-subtracted exponentials summed in acc_t<T> (f32 for f32 and bf16,
// f64 for f64). Cross-entropy keeps lse in f64 like the CPU kernel and reduces
// the row losses in a fixed order (deterministic), entirely on the device: the
// loss and its incoming gradient never visit the host.
#include <algorithm>

#include "ops/common/cuda_helpers.cuh"
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

// lse[r] = log Σ e^{x[r]} (f64; -inf for an all -inf row); row_loss[r] = lse -
// x[r, target] for counted rows, 0 for ignored ones.
template <class T, class I>
__global__ void cross_entropy_rows_kernel(double* lse, double* row_loss, const T* x, const I* targets, int64_t rows,
                                          int64_t v, int64_t ignore_index) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * v;
    A m = row_max(xr, v), s = 0;
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) s += exp_a(load(xr, j) - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
      double l = isinf(m) && m < 0 ? static_cast<double>(m) : static_cast<double>(m) + ::log(static_cast<double>(s));
      lse[r] = l;
      int64_t t = static_cast<int64_t>(targets[r]);
      row_loss[r] = t == ignore_index ? 0.0 : l - static_cast<double>(load(xr, t));
    }
  }
}

// loss[0] = Σ_r row_loss[r] / divisor, in a fixed order (one block).
template <class T>
__global__ void cross_entropy_total_kernel(T* loss, const double* row_loss, int64_t rows, double divisor) {
  double s = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) s += row_loss[r];
  s = block_sum(s);
  if (threadIdx.x == 0) store(loss, 0, static_cast<acc_t<T>>(s / divisor));
}

// grad[r, :] = scale e^{x - lse} with scale = grad_loss · inv_divisor; the target
// entry scale (e^{x_t - lse} - 1) in f64; ignored rows 0.
template <class T, class I>
__global__ void cross_entropy_backward_kernel(T* grad, const T* x, const I* targets, const double* lse,
                                              const T* grad_loss, double inv_divisor, int64_t rows, int64_t v,
                                              int64_t ignore_index) {
  using A = acc_t<T>;
  double scale = static_cast<double>(load(grad_loss, 0)) * inv_divisor;
  A sc = static_cast<A>(scale);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* gr = grad + r * v;
    const T* xr = x + r * v;
    int64_t t = static_cast<int64_t>(targets[r]);
    if (t == ignore_index) {
      for (int64_t j = threadIdx.x; j < v; j += blockDim.x) store(gr, j, A(0));
      continue;
    }
    double l = lse[r];
    A lt = static_cast<A>(l);
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      if (j == t) store(gr, j, static_cast<A>(scale * (::exp(static_cast<double>(load(xr, j)) - l) - 1.0)));
      else store(gr, j, sc * exp_a(load(xr, j) - lt));
    }
  }
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

void cross_entropy_forward(Tensor& lse, Tensor& loss, const Tensor& logits, const Tensor& targets,
                           int64_t ignore_index, double divisor) {
  auto [rows, v] = rows_cols(logits);
  Tensor row_loss = empty({rows}, DType::f64, logits.device());
  dispatch_float_cuda(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy", [&](auto itag) {
      using I = decltype(itag);
      cudaStream_t s = stream_of(logits);
      if (rows > 0) {
        launch("cross_entropy_rows_kernel", cross_entropy_rows_kernel<T, I>, row_blocks(rows), kThreads, 0, s,
               ptr<double>(lse), ptr<double>(row_loss), ptr<T>(logits), ptr<I>(targets), rows, v, ignore_index);
      }
      launch("cross_entropy_total_kernel", cross_entropy_total_kernel<T>, 1, 1024, 0, s, ptr<T>(loss),
             ptr<double>(row_loss), rows, divisor);
    });
  });
}

void cross_entropy_backward(Tensor& grad_logits, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            const Tensor& grad_loss, double inv_divisor, int64_t ignore_index) {
  auto [rows, v] = rows_cols(logits);
  if (rows == 0 || v == 0) return;
  dispatch_float_cuda(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy_backward", [&](auto itag) {
      using I = decltype(itag);
      launch("cross_entropy_backward_kernel", cross_entropy_backward_kernel<T, I>, row_blocks(rows), kThreads, 0,
             stream_of(logits), ptr<T>(grad_logits), ptr<T>(logits), ptr<I>(targets), ptr<double>(lse),
             ptr<T>(grad_loss), inv_divisor, rows, v, ignore_index);
    });
  });
}

}  // namespace moetrain::cuda
