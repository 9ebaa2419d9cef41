// CUDA kernels of the decay gate (twins of decay_gate_cpu.cpp, same formulas),
// elementwise in acc_t<T>; e^{A_log[h]} per element (one exp, cheaper than a
// second pass).
#include "ops/common/cuda_helpers.cuh"
#include "ops/kda/decay_gate_kernels.h"

namespace moetrain::cuda {

namespace {

template <class A> __device__ __forceinline__ A softplus_a(A x) { return max(x, A(0)) + log1p(exp_a(-fabs(x))); }

template <class T>
__global__ void decay_gate_forward_kernel(T* g, const T* f, const T* A_log, const T* dt_bias, int64_t n, int64_t K,
                                          int64_t HK, double lower_bound) {
  using A = acc_t<T>;
  const A lb = static_cast<A>(lower_bound);
  MT_GRID_LOOP(i, n) {
    const int64_t c = i % HK;
    A a = exp_a(load(A_log, c / K)), u = load(f, i) + load(dt_bias, c);
    store(g, i, lower_bound != 0.0 ? lb * sigmoid_a(a * u) : -a * softplus_a(u));
  }
}

template <class T>
__global__ void decay_gate_backward_kernel(T* df, T* da, const T* dg, const T* g, const T* f, const T* A_log,
                                           const T* dt_bias, int64_t n, int64_t K, int64_t HK, double lower_bound) {
  using A = acc_t<T>;
  const A lb = static_cast<A>(lower_bound);
  MT_GRID_LOOP(i, n) {
    const int64_t c = i % HK;
    A a = exp_a(load(A_log, c / K)), u = load(f, i) + load(dt_bias, c), d = load(dg, i);
    if (lower_bound != 0.0) {
      A s = sigmoid_a(a * u), dfi = d * lb * s * (A(1) - s) * a;
      store(df, i, dfi);
      if (da) store(da, i, dfi * u);
    } else {
      store(df, i, -d * a * sigmoid_a(u));
      if (da) store(da, i, d * load(g, i));  // ∂g/∂A_log = g
    }
  }
}

}  // namespace

void decay_gate_forward(Tensor& g, const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, double lower_bound) {
  const int64_t n = f.numel();
  if (n == 0) return;
  dispatch_float_cuda(f.dtype(), "decay_gate", [&](auto tag) {
    using T = decltype(tag);
    launch("decay_gate_forward_kernel", decay_gate_forward_kernel<T>, blocks_for(n), kThreads, 0, stream_of(f),
           ptr<T>(g), ptr<T>(f), ptr<T>(A_log), ptr<T>(dt_bias), n, f.size(-1), dt_bias.numel(), lower_bound);
  });
}

void decay_gate_backward(Tensor& grad_f, Tensor* grad_a, const Tensor& grad_g, const Tensor& g, const Tensor& f,
                         const Tensor& A_log, const Tensor& dt_bias, double lower_bound) {
  const int64_t n = f.numel();
  if (n == 0) return;
  dispatch_float_cuda(f.dtype(), "decay_gate_backward", [&](auto tag) {
    using T = decltype(tag);
    launch("decay_gate_backward_kernel", decay_gate_backward_kernel<T>, blocks_for(n), kThreads, 0, stream_of(f),
           ptr<T>(grad_f), grad_a ? ptr<T>(*grad_a) : nullptr, ptr<T>(grad_g), ptr<T>(g), ptr<T>(f), ptr<T>(A_log),
           ptr<T>(dt_bias), n, f.size(-1), dt_bias.numel(), lower_bound);
  });
}

}  // namespace moetrain::cuda
