// CUDA kernels of renormalize_rows (route_weights.h): a thread per row (k, the
// router's top_k, is small), the row's arithmetic in route_weights_simt.h (the CPU's
// too), in the compute type.
#include "backend/cuda/kernel_utils.cuh"
#include "ops/router/route_weights_kernels.h"
#include "ops/router/route_weights_simt.h"

namespace moetrain::cuda {

namespace {

template <class T>
__global__ void renormalize_rows_kernel(T* y, const T* w, int64_t rows, int64_t k, acc_t<T> eps) {
  MT_GRID_LOOP(r, rows) {
    const T* wr = w + r * k;
    const acc_t<T> den = simt::renormalize_denominator([wr](int64_t j) { return load(wr, j); }, k, eps);
    for (int64_t j = 0; j < k; ++j) store(y, r * k + j, load(wr, j) / den);
  }
}

template <class T>
__global__ void renormalize_rows_backward_kernel(T* grad_w, const T* grad_y, const T* w, int64_t rows, int64_t k,
                                                 acc_t<T> eps) {
  MT_GRID_LOOP(r, rows) {
    const T* wr = w + r * k;
    const T* gr = grad_y + r * k;
    auto load_w = [wr](int64_t j) { return load(wr, j); };
    const acc_t<T> den = simt::renormalize_denominator(load_w, k, eps);
    const acc_t<T> dot = simt::renormalize_dot(load_w, [gr](int64_t j) { return load(gr, j); }, k, den);
    for (int64_t j = 0; j < k; ++j) store(grad_w, r * k + j, (load(gr, j) - dot) / den);
  }
}

}  // namespace

void renormalize_rows_forward(Tensor& y, const Tensor& w, double eps) {
  const int64_t k = w.size(-1), rows = k > 0 ? w.numel() / k : 0;
  if (rows == 0) return;
  dispatch_float_cuda(w.dtype(), "renormalize_rows", [&](auto tag) {
    using T = decltype(tag);
    launch("renormalize_rows_kernel", renormalize_rows_kernel<T>, blocks_for(rows), kThreads, 0, stream_of(w),
           ptr<T>(y), ptr<T>(w), rows, k, static_cast<acc_t<T>>(eps));
  });
}

void renormalize_rows_backward(Tensor& grad_w, const Tensor& grad_y, const Tensor& w, double eps) {
  const int64_t k = w.size(-1), rows = k > 0 ? w.numel() / k : 0;
  if (rows == 0) return;
  dispatch_float_cuda(w.dtype(), "renormalize_rows_backward", [&](auto tag) {
    using T = decltype(tag);
    launch("renormalize_rows_backward_kernel", renormalize_rows_backward_kernel<T>, blocks_for(rows), kThreads, 0,
           stream_of(w), ptr<T>(grad_w), ptr<T>(grad_y), ptr<T>(w), rows, k, static_cast<acc_t<T>>(eps));
  });
}

}  // namespace moetrain::cuda
