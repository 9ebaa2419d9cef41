// CPU kernels of the decay gate: elementwise in T (the composite ops' precision),
// e^{A_log} per head computed once in double.
#include <cmath>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/decay_gate_kernels.h"
#include "ops/math.h"

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

// Calls fn(i, a, u) for every element i of f, a = e^{A_log[h]}, u = f + dt_bias.
template <class T, class Fn>
void for_each_element(const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, Fn fn) {
  const int64_t K = f.size(-1), HK = dt_bias.numel();
  const std::vector<T> a = head_rates<T>(A_log);
  const T* pf = f.data<T>();
  const T* pb = dt_bias.data<T>();
  parallel_for(f.numel(), 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c = i % HK;
      fn(i, a[static_cast<size_t>(c / K)], pf[i] + pb[c]);
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
      for_each_element<T>(f, A_log, dt_bias, [&](int64_t i, T a, T u) { pg[i] = lb * sigmoid_of(a * u); });
    else
      for_each_element<T>(f, A_log, dt_bias, [&](int64_t i, T a, T u) { pg[i] = -a * softplus_t(u); });
  });
}

void decay_gate_backward(Tensor& grad_f, Tensor* grad_a, const Tensor& grad_g, const Tensor& f, const Tensor& A_log,
                         const Tensor& dt_bias, double lower_bound) {
  dispatch_float(f.dtype(), "decay_gate_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* dg = grad_g.data<T>();
    T* df = grad_f.data<T>();
    T* da = grad_a ? grad_a->data<T>() : nullptr;
    const T lb = static_cast<T>(lower_bound);
    if (lower_bound != 0.0)
      for_each_element<T>(f, A_log, dt_bias, [&](int64_t i, T a, T u) {
        T s = sigmoid_of(a * u), d = dg[i] * lb * s * (T(1) - s) * a;
        df[i] = d;
        if (da) da[i] = d * u;
      });
    else
      for_each_element<T>(f, A_log, dt_bias, [&](int64_t i, T a, T u) {
        df[i] = -dg[i] * a * sigmoid_of(u);
        if (da) da[i] = -dg[i] * a * softplus_t(u);
      });
  });
}

}  // namespace moetrain::cpu
