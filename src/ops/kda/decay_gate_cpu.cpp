// CPU kernels of the decay gate: elementwise in T (the composite ops' precision),
// e^{A_log} per head computed once in double.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/kda/decay_gate_kernels.h"
#include "ops/common/math.h"

namespace moetrain::cpu {

namespace {

template <class T>
T softplus_t(T x) {  // log(1 + e^x) = max(x, 0) + log1p(e^-|x|)
  return std::max(x, T(0)) + std::log1p(std::exp(-std::abs(x)));
}

template <class T>
std::vector<T> head_rates(const Tensor& A_log) {
  std::vector<T> a(static_cast<size_t>(A_log.numel()));
  const T* p = A_log.data<T>();
  for (size_t h = 0; h < a.size(); ++h) a[h] = static_cast<T>(std::exp(static_cast<double>(p[h])));
  return a;
}

// The lower-bound gate's loops over one head's K values, with an AVX2 + FMA copy
// picked at load time (target_clones): σ by exp_approx runs vectorised.
template <class T>
__attribute__((target_clones("arch=x86-64-v3", "default"))) void safe_gate_row(T* __restrict g,
                                                                               const T* __restrict u, T a, T lb,
                                                                               int64_t n) {
  for (int64_t d = 0; d < n; ++d) g[d] = lb * sigmoid_of(a * u[d]);
}
template <class T>
__attribute__((target_clones("arch=x86-64-v3", "default"))) void safe_gate_grad_row(
    T* __restrict df, const T* __restrict dg, const T* __restrict u, T a, T lb, int64_t n) {
  for (int64_t d = 0; d < n; ++d) {
    const T s = sigmoid_of(a * u[d]);
    df[d] = dg[d] * lb * s * (T(1) - s) * a;
  }
}

// Calls fn(p, a, u, n) for every run of n = K elements of one head: p the run's
// offset in f, a = e^{A_log[h]}, u = f + dt_bias for the run (K contiguous values,
// so fn's loop over them vectorises).
template <class T, class Fn>
void for_each_head_run(const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, Fn fn) {
  const int64_t K = f.size(-1), H = A_log.numel(), runs = f.numel() / std::max<int64_t>(K, 1);
  const std::vector<T> a = head_rates<T>(A_log);
  const T* pf = f.data<T>();
  const T* pb = dt_bias.data<T>();
  parallel_for(runs, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<T> u(static_cast<size_t>(K));
    for (int64_t run = lo; run < hi; ++run) {
      const int64_t h = run % H, p = run * K;
      for (int64_t d = 0; d < K; ++d) u[static_cast<size_t>(d)] = pf[p + d] + pb[h * K + d];
      fn(p, a[static_cast<size_t>(h)], u.data(), K);
    }
  });
}

}  // namespace

void decay_gate_forward(Tensor& g, const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, double lower_bound) {
  dispatch_float(f.dtype(), "decay_gate", [&](auto tag) {
    using T = decltype(tag);
    T* pg = g.data<T>();
    const T lb = static_cast<T>(lower_bound);
    if (lower_bound != 0.0)
      for_each_head_run<T>(f, A_log, dt_bias,
                           [&](int64_t p, T a, const T* u, int64_t n) { safe_gate_row(pg + p, u, a, lb, n); });
    else
      for_each_head_run<T>(f, A_log, dt_bias, [&](int64_t p, T a, const T* u, int64_t n) {
        for (int64_t d = 0; d < n; ++d) pg[p + d] = -a * softplus_t(u[d]);
      });
  });
}

void decay_gate_backward(Tensor& grad_f, Tensor* grad_a, const Tensor& grad_g, const Tensor& g, const Tensor& f,
                         const Tensor& A_log, const Tensor& dt_bias, double lower_bound) {
  dispatch_float(f.dtype(), "decay_gate_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* dg = grad_g.data<T>();
    const T* pg = g.data<T>();
    T* df = grad_f.data<T>();
    T* da = grad_a ? grad_a->data<T>() : nullptr;
    const T lb = static_cast<T>(lower_bound);
    if (lower_bound != 0.0)
      for_each_head_run<T>(f, A_log, dt_bias, [&](int64_t p, T a, const T* u, int64_t n) {
        safe_gate_grad_row(df + p, dg + p, u, a, lb, n);
        if (da)
          for (int64_t d = 0; d < n; ++d) da[p + d] = df[p + d] * u[d];
      });
    else
      for_each_head_run<T>(f, A_log, dt_bias, [&](int64_t p, T a, const T* u, int64_t n) {
        for (int64_t d = 0; d < n; ++d) df[p + d] = -dg[p + d] * a * sigmoid_of(u[d]);
        if (da)
          for (int64_t d = 0; d < n; ++d) da[p + d] = dg[p + d] * pg[p + d];
      });
  });
}

}  // namespace moetrain::cpu
