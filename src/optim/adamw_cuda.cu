#include "optim/adamw_kernels.h"

#include <type_traits>

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

// The kernels above with the stores replaced by a count: each block adds the
// elements whose new w, m or v (in mixed precision also bf16(master)) would be
// NaN or infinite to *count, one integer atomic per block that found any
// (integer sums: the same total in any order).
template <class T, class G>
__global__ void adamw_count_kernel(unsigned long long* count, const T* __restrict__ w, const G* __restrict__ g,
                                   const T* __restrict__ m, const T* __restrict__ v, int64_t n, AdamWCoefficients k) {
  const AdamWScalars<T> c(k);
  unsigned long long bad = 0;
  MT_GRID_LOOP(j, n) {
    const AdamWElement<T> u = adamw_element<T>(w[j], load(g, j), m[j], v[j], c);
    bool finite = isfinite(u.w) && isfinite(u.m) && isfinite(u.v);
    if constexpr (std::is_same_v<G, bf16_t>) finite = finite && isfinite(__bfloat162float(__float2bfloat16_rn(u.w)));
    bad += !finite;
  }
  bad = block_sum(bad);
  if (threadIdx.x == 0 && bad > 0) atomicAdd(count, bad);
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
      launch("adamw_kernel", adamw_kernel<float>, blocks_for(n), kThreads, 0, stream_of(w), ptr<float>(w),
             ptr<float>(g), ptr<float>(m), ptr<float>(v), n, k);
      break;
    case DType::f64:
      launch("adamw_kernel", adamw_kernel<double>, blocks_for(n), kThreads, 0, stream_of(w), ptr<double>(w),
             ptr<double>(g), ptr<double>(m), ptr<double>(v), n, k);
      break;
    default: MT_THROW("adamw: parameters must be f32 or f64 (master weights), got {}", w.dtype());
  }
}

void adamw_update_bf16_master(Tensor& w, const Tensor& g, Tensor& master, Tensor& m, Tensor& v,
                              const AdamWCoefficients& k) {
  int64_t n = w.numel();
  if (n == 0) return;
  MT_CHECK(w.dtype() == DType::bf16 && g.dtype() == DType::bf16 && master.dtype() == DType::f32 &&
               m.dtype() == DType::f32 && v.dtype() == DType::f32,
           "adamw (mixed precision): expected bf16 parameter and gradient, f32 master and moments; got {}, {}, {}, "
           "{}, {}", describe(w), describe(g), describe(master), describe(m), describe(v));
  launch("adamw_bf16_master_kernel", adamw_bf16_master_kernel, blocks_for(n), kThreads, 0, stream_of(w), ptr<bf16_t>(w),
         ptr<bf16_t>(g), ptr<float>(master), ptr<float>(m), ptr<float>(v), n, k);
}

void adamw_count_non_finite(Tensor& counts, int64_t index, const Tensor& w, const Tensor& g, const Tensor& m,
                            const Tensor& v, const AdamWCoefficients& k) {
  int64_t n = w.numel();
  if (n == 0) return;
  unsigned long long* count = reinterpret_cast<unsigned long long*>(ptr<int64_t>(counts) + index);
  switch (w.dtype()) {
    case DType::f32:
      launch("adamw_count_kernel", adamw_count_kernel<float, float>, blocks_for(n), kThreads, 0, stream_of(w), count,
             ptr<float>(w), ptr<float>(g), ptr<float>(m), ptr<float>(v), n, k);
      break;
    case DType::f64:
      launch("adamw_count_kernel", adamw_count_kernel<double, double>, blocks_for(n), kThreads, 0, stream_of(w), count,
             ptr<double>(w), ptr<double>(g), ptr<double>(m), ptr<double>(v), n, k);
      break;
    default: MT_THROW("adamw: parameters must be f32 or f64 (master weights), got {}", w.dtype());
  }
}

void adamw_count_non_finite_bf16_master(Tensor& counts, int64_t index, const Tensor& g, const Tensor& master,
                                        const Tensor& m, const Tensor& v, const AdamWCoefficients& k) {
  int64_t n = master.numel();
  if (n == 0) return;
  MT_CHECK(g.dtype() == DType::bf16 && master.dtype() == DType::f32 && m.dtype() == DType::f32 &&
               v.dtype() == DType::f32,
           "adamw (mixed precision): expected a bf16 gradient, f32 master and moments; got {}, {}, {}, {}",
           describe(g), describe(master), describe(m), describe(v));
  unsigned long long* count = reinterpret_cast<unsigned long long*>(ptr<int64_t>(counts) + index);
  launch("adamw_count_kernel", adamw_count_kernel<float, bf16_t>, blocks_for(n), kThreads, 0, stream_of(master), count,
         ptr<float>(master), ptr<bf16_t>(g), ptr<float>(m), ptr<float>(v), n, k);
}

void add_squared_sum(Tensor& acc, const Tensor& g) {
  int64_t n = g.numel();
  if (n == 0) return;
  Tensor partial = empty({kSumBlocks}, DType::f64, g.device());
  dispatch_float_cuda(g.dtype(), "clip_grad_norm", [&](auto tag) {
    using T = decltype(tag);
    launch("squared_sum_partial", squared_sum_partial<T>, kSumBlocks, kThreads, 0, stream_of(g), ptr<double>(partial),
           ptr<T>(g), n);
  });
  launch("add_partials", add_partials, 1, kThreads, 0, stream_of(g), ptr<double>(acc), ptr<double>(partial),
         kSumBlocks);
}

void scale(Tensor& g, double coef) {
  int64_t n = g.numel();
  if (n == 0) return;
  dispatch_float_cuda(g.dtype(), "clip_grad_norm", [&](auto tag) {
    using T = decltype(tag);
    launch("scale_kernel", scale_kernel<T>, blocks_for(n), kThreads, 0, stream_of(g), ptr<T>(g),
           static_cast<acc_t<T>>(coef), n);
  });
}

}  // namespace moetrain::cuda
