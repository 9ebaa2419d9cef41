#include "optim/adamw_kernels.h"

#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

namespace {

// adamw_element (adamw_kernels.h), as adamw.cpp's loop computes it.
template <class T>
__global__ void adamw_kernel(T* __restrict__ w, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                             int64_t n, AdamWCoefficients k) {
  const AdamWScalars<T> c(k);
  MT_GRID_LOOP(j, n) {
    const AdamWElement<T> u = adamw_element<T>(w[j], g[j], m[j], v[j], c);
    m[j] = u.m;
    v[j] = u.v;
    w[j] = u.w;
  }
}

// Mixed precision: the f32 kernel's arithmetic on the master copy; the bf16
// parameter receives the master rounded to nearest even.
__global__ void adamw_bf16_master_kernel(bf16_t* __restrict__ w, const bf16_t* __restrict__ g,
                                         float* __restrict__ master, float* __restrict__ m, float* __restrict__ v,
                                         int64_t n, AdamWCoefficients k) {
  const AdamWScalars<float> c(k);
  MT_GRID_LOOP(j, n) {
    const AdamWElement<float> u = adamw_element<float>(master[j], load(g, j), m[j], v[j], c);
    m[j] = u.m;
    v[j] = u.v;
    master[j] = u.w;
    store(w, j, u.w);
  }
}

// A fixed grid (kSumBlocks x kThreads): each block sums a fixed set of elements
// into partial[block]; one block then adds the partials in order to acc.
constexpr int kSumBlocks = 256;

template <class T> __global__ void squared_sum_partial(double* partial, const T* g, int64_t n) {
  double s = 0;
  MT_GRID_LOOP(j, n) {
    double x = static_cast<double>(load(g, j));
    s += x * x;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void add_partials(double* acc, const double* partial, int count) {
  double s = sum_partials(partial, count);
  if (threadIdx.x == 0) acc[0] += s;
}

template <class T> __global__ void scale_kernel(T* g, acc_t<T> c, int64_t n) {
  MT_GRID_LOOP(j, n) store(g, j, load(g, j) * c);
}

}  // namespace

void adamw_update(Tensor& w, const Tensor& g, Tensor& m, Tensor& v, const AdamWCoefficients& k) {
  int64_t n = w.numel();
  if (n == 0) return;
  switch (w.dtype()) {
    case DType::f32:
      adamw_kernel<float><<<blocks_for(n), kThreads, 0, stream_of(w)>>>(ptr<float>(w), ptr<float>(g), ptr<float>(m),
                                                                        ptr<float>(v), n, k);
      break;
    case DType::f64:
      adamw_kernel<double><<<blocks_for(n), kThreads, 0, stream_of(w)>>>(ptr<double>(w), ptr<double>(g),
                                                                         ptr<double>(m), ptr<double>(v), n, k);
      break;
    default: MT_THROW("adamw: parameters must be f32 or f64 (master weights), got {}", w.dtype());
  }
  MT_CUDA_CHECK_LAUNCH("adamw");
}

void adamw_update_bf16_master(Tensor& w, const Tensor& g, Tensor& master, Tensor& m, Tensor& v,
                              const AdamWCoefficients& k) {
  int64_t n = w.numel();
  if (n == 0) return;
  MT_CHECK(w.dtype() == DType::bf16 && g.dtype() == DType::bf16 && master.dtype() == DType::f32 &&
               m.dtype() == DType::f32 && v.dtype() == DType::f32,
           "adamw (mixed precision): expected bf16 parameter and gradient, f32 master and moments; got {}, {}, {}, "
           "{}, {}", describe(w), describe(g), describe(master), describe(m), describe(v));
  adamw_bf16_master_kernel<<<blocks_for(n), kThreads, 0, stream_of(w)>>>(
      ptr<bf16_t>(w), ptr<bf16_t>(g), ptr<float>(master), ptr<float>(m), ptr<float>(v), n, k);
  MT_CUDA_CHECK_LAUNCH("adamw");
}

void add_squared_sum(Tensor& acc, const Tensor& g) {
  int64_t n = g.numel();
  if (n == 0) return;
  Tensor partial = empty({kSumBlocks}, DType::f64, g.device());
  dispatch_float_cuda(g.dtype(), "clip_grad_norm", [&](auto tag) {
    using T = decltype(tag);
    squared_sum_partial<T><<<kSumBlocks, kThreads, 0, stream_of(g)>>>(ptr<double>(partial), ptr<T>(g), n);
  });
  add_partials<<<1, kThreads, 0, stream_of(g)>>>(ptr<double>(acc), ptr<double>(partial), kSumBlocks);
  MT_CUDA_CHECK_LAUNCH("clip_grad_norm");
}

void scale(Tensor& g, double coef) {
  int64_t n = g.numel();
  if (n == 0) return;
  dispatch_float_cuda(g.dtype(), "clip_grad_norm", [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(g)>>>(ptr<T>(g), static_cast<acc_t<T>>(coef), n);
  });
  MT_CUDA_CHECK_LAUNCH("scale");
}

}  // namespace moetrain::cuda
