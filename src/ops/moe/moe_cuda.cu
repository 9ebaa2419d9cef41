// CUDA twin of the grouped expert GEMMs (moe_cpu.cpp): every expert with rows in
// one cuBLAS grouped-batched GEMM per product (cuda::gemm_grouped; f64 takes a
// GEMM per expert), on the device's stream; the counts are on the host. The
// combine's kernels: one thread per (token, column) summing the slots in order;
// backward one thread per (token, slot, column) for the rows (each row is one
// slot's) and one warp per (token, slot) for the weight's dot product, so no
// atomics and the same result run to run.
#include "ops/moe/moe_kernels.h"

#include <vector>

#include "backend/cuda/cublas.h"
#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1), es = dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw_data());
  const char* pw = static_cast<const char*>(w.raw_data());
  char* py = static_cast<char*>(y.raw_data());
  std::vector<GemmItem> items;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t m = counts[e];
    // y_e [m, out] = x_e [m, in] w_e^T
    items.push_back({m, out, in, px + row * in * es, in, pw + static_cast<int64_t>(e) * out * in * es, in,
                     py + row * out * es, out});
    row += m;
  }
  gemm_grouped(x.dtype(), false, true, items, x.device().index);
}

void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                             const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1), es = dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw_data());
  const char* pw = static_cast<const char*>(w.raw_data());
  const char* pdy = static_cast<const char*>(dy.raw_data());
  char* pdx = static_cast<char*>(dx.raw_data());
  char* pdw = static_cast<char*>(dw.raw_data());
  const int dev = x.device().index;
  std::vector<GemmItem> data, weight;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t m = counts[e];
    char* dw_e = pdw + static_cast<int64_t>(e) * out * in * es;
    if (m == 0) {
      memset_zero(dw_e, out * in * es, dev);
      continue;
    }
    // dx_e [m, in] = dy_e [m, out] w_e [out, in];  dw_e [out, in] = dy_e^T x_e
    data.push_back({m, in, out, pdy + row * out * es, out, pw + static_cast<int64_t>(e) * out * in * es, in,
                    pdx + row * in * es, in});
    weight.push_back({out, in, m, pdy + row * out * es, out, px + row * in * es, in, dw_e, in});
    row += m;
  }
  gemm_grouped(x.dtype(), false, false, data, dev);
  gemm_grouped(x.dtype(), true, false, weight, dev);
}

namespace {

template <class T>
__global__ void moe_combine_kernel(T* y, const T* rows, const int64_t* idx, const T* w, int64_t M, int64_t W,
                                   int64_t N, int64_t k) {
  MT_GRID_LOOP(e, N * W) {
    const int64_t n = e / W, c = e % W;
    acc_t<T> sum = 0;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t r = idx[n * k + s];
      if (r < M) sum += load(w, n * k + s) * load(rows, r * W + c);
    }
    store(y, e, sum);
  }
}

template <class T>
__global__ void moe_combine_rows_grad_kernel(T* grad_rows, const T* dy, const int64_t* idx, const T* w, int64_t M,
                                             int64_t W, int64_t N, int64_t k) {
  MT_GRID_LOOP(e, N * k * W) {
    const int64_t slot = e / W, c = e % W, r = idx[slot];
    if (r < M) store(grad_rows, r * W + c, load(w, slot) * load(dy, (slot / k) * W + c));
  }
}

// One warp per (token, slot): lanes stride the columns, then a warp sum.
template <class T>
__global__ void moe_combine_weights_grad_kernel(T* grad_w, const T* dy, const T* rows, const int64_t* idx, int64_t M,
                                                int64_t W, int64_t N, int64_t k) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x & 31;
  for (int64_t slot = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5); slot < N * k;
       slot += warps) {
    const int64_t r = idx[slot], n = slot / k;
    acc_t<T> dot = 0;
    if (r < M)
      for (int64_t c = lane; c < W; c += 32) dot += load(rows, r * W + c) * load(dy, n * W + c);
    dot = warp_sum(dot);
    if (lane == 0) store(grad_w, slot, dot);
  }
}

}  // namespace

void moe_combine_forward(Tensor& y, const Tensor& rows, const Tensor& slot_rows, const Tensor& weights) {
  const int64_t M = rows.size(0), W = rows.size(1), N = weights.size(0), k = weights.size(1);
  if (N * W == 0) return;
  dispatch_float_cuda(rows.dtype(), "moe_combine", [&](auto tag) {
    using T = decltype(tag);
    launch("moe_combine_kernel", moe_combine_kernel<T>, blocks_for(N * W), kThreads, 0, stream_of(rows), ptr<T>(y),
           ptr<T>(rows), ptr<int64_t>(slot_rows), ptr<T>(weights), M, W, N, k);
  });
}

void moe_combine_backward(Tensor& grad_rows, Tensor& grad_weights, const Tensor& dy, const Tensor& rows,
                          const Tensor& slot_rows, const Tensor& weights) {
  const int64_t M = rows.size(0), W = rows.size(1), N = weights.size(0), k = weights.size(1);
  if (N * k == 0) return;
  dispatch_float_cuda(rows.dtype(), "moe_combine_backward", [&](auto tag) {
    using T = decltype(tag);
    if (W > 0)
      launch("moe_combine_rows_grad_kernel", moe_combine_rows_grad_kernel<T>, blocks_for(N * k * W), kThreads, 0,
             stream_of(rows), ptr<T>(grad_rows), ptr<T>(dy), ptr<int64_t>(slot_rows), ptr<T>(weights), M, W, N, k);
    launch("moe_combine_weights_grad_kernel", moe_combine_weights_grad_kernel<T>, blocks_for(N * k * 32), kThreads,
           0, stream_of(rows), ptr<T>(grad_weights), ptr<T>(dy), ptr<T>(rows), ptr<int64_t>(slot_rows), M, W, N, k);
  });
}

}  // namespace moetrain::cuda
