// AttnRes read kernels. Forward and the per-source gradients are parallel over
// tokens; the pseudo-query / norm gradients over the model dim (each thread owns
// a range of d and sums over tokens in order), so every result is independent
// of the thread count. Scores and softmax in double.
#include <cmath>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/attnres/attnres_kernels.h"

namespace moetrain::cpu {

namespace {
constexpr int64_t kTokenGrain = 16;
}

void attn_res_forward(Tensor& h, Tensor& alpha, Tensor& rstd, const std::vector<const Tensor*>& sources,
                      const Tensor& proj, const Tensor& norm, double eps) {
  dispatch_float(h.dtype(), "attn_res", [&](auto tag) {
    using T = decltype(tag);
    const int64_t M = static_cast<int64_t>(sources.size());
    const int64_t D = h.size(-1), N = h.numel() / std::max<int64_t>(D, 1);
    std::vector<const T*> src(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) src[static_cast<size_t>(m)] = sources[static_cast<size_t>(m)]->data<T>();
    const T* pw = proj.data<T>();
    const T* pn = norm.data<T>();
    std::vector<T> u(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d) u[static_cast<size_t>(d)] = pw[d] * pn[d];
    T* ph = h.data<T>();
    T* pa = alpha.data<T>();
    T* pr = rstd.data<T>();
    parallel_for(N, kTokenGrain, [&](int64_t lo, int64_t hi) {
      std::vector<double> s(static_cast<size_t>(M));
      for (int64_t n = lo; n < hi; ++n) {
        double smax = -INFINITY;
        for (int64_t m = 0; m < M; ++m) {
          const T* v = src[static_cast<size_t>(m)] + n * D;
          double sq = 0, dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            sq += static_cast<double>(v[d]) * v[d];
            dot += static_cast<double>(v[d]) * u[static_cast<size_t>(d)];
          }
          double r = 1.0 / std::sqrt(sq / static_cast<double>(D) + eps);
          pr[n * M + m] = static_cast<T>(r);
          s[static_cast<size_t>(m)] = dot * r;
          smax = std::max(smax, s[static_cast<size_t>(m)]);
        }
        double z = 0;
        for (int64_t m = 0; m < M; ++m) z += (s[static_cast<size_t>(m)] = std::exp(s[static_cast<size_t>(m)] - smax));
        T* hr = ph + n * D;
        for (int64_t d = 0; d < D; ++d) hr[d] = T(0);
        for (int64_t m = 0; m < M; ++m) {
          T a = static_cast<T>(s[static_cast<size_t>(m)] / z);
          pa[n * M + m] = a;
          const T* v = src[static_cast<size_t>(m)] + n * D;
          for (int64_t d = 0; d < D; ++d) hr[d] += a * v[d];
        }
      }
    });
  });
}

void attn_res_backward(std::vector<Tensor>& grad_sources, Tensor* grad_proj, Tensor* grad_norm,
                       const Tensor& grad_h, const std::vector<const Tensor*>& sources, const Tensor& proj,
                       const Tensor& norm, const Tensor& alpha, const Tensor& rstd) {
  dispatch_float(grad_h.dtype(), "attn_res_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t M = static_cast<int64_t>(sources.size());
    const int64_t D = grad_h.size(-1), N = grad_h.numel() / std::max<int64_t>(D, 1);
    std::vector<const T*> src(static_cast<size_t>(M));
    std::vector<T*> dsrc(static_cast<size_t>(M), nullptr);
    for (int64_t m = 0; m < M; ++m) {
      src[static_cast<size_t>(m)] = sources[static_cast<size_t>(m)]->data<T>();
      if (grad_sources[static_cast<size_t>(m)].defined()) dsrc[static_cast<size_t>(m)] = grad_sources[static_cast<size_t>(m)].data<T>();
    }
    const T* pw = proj.data<T>();
    const T* pn = norm.data<T>();
    const T* pa = alpha.data<T>();
    const T* pr = rstd.data<T>();
    const T* dh = grad_h.data<T>();
    std::vector<T> u(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d) u[static_cast<size_t>(d)] = pw[d] * pn[d];
    // c[n, m] = ds_m r_m: the coefficient of V_m in du, and of (u − K_m s_m / D) in dV_m.
    std::vector<T> coef(static_cast<size_t>(N * M));
    parallel_for(N, kTokenGrain, [&](int64_t lo, int64_t hi) {
      std::vector<double> dp(static_cast<size_t>(M)), s(static_cast<size_t>(M));
      for (int64_t n = lo; n < hi; ++n) {
        const T* g = dh + n * D;
        double mean_dp = 0;
        for (int64_t m = 0; m < M; ++m) {
          const T* v = src[static_cast<size_t>(m)] + n * D;
          double acc = 0, dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            acc += static_cast<double>(g[d]) * v[d];
            dot += static_cast<double>(v[d]) * u[static_cast<size_t>(d)];
          }
          dp[static_cast<size_t>(m)] = acc;
          s[static_cast<size_t>(m)] = dot * pr[n * M + m];
          mean_dp += pa[n * M + m] * acc;
        }
        for (int64_t m = 0; m < M; ++m) {
          double a = pa[n * M + m], r = pr[n * M + m];
          double ds = a * (dp[static_cast<size_t>(m)] - mean_dp);
          coef[static_cast<size_t>(n * M + m)] = static_cast<T>(ds * r);
          T* dv = dsrc[static_cast<size_t>(m)];
          if (!dv) continue;
          dv += n * D;
          const T* v = src[static_cast<size_t>(m)] + n * D;
          // dV_m = α_m dh + ds_m r_m (u − V_m r_m s_m / D)
          T ta = static_cast<T>(a), tc = static_cast<T>(ds * r), tk = static_cast<T>(r * s[static_cast<size_t>(m)] / static_cast<double>(D));
          for (int64_t d = 0; d < D; ++d) dv[d] = ta * g[d] + tc * (u[static_cast<size_t>(d)] - v[d] * tk);
        }
      }
    });
    if (!grad_proj && !grad_norm) return;
    T* dw = grad_proj ? grad_proj->data<T>() : nullptr;
    T* dn = grad_norm ? grad_norm->data<T>() : nullptr;
    parallel_for(D, 8, [&](int64_t lo, int64_t hi) {
      std::vector<double> du(static_cast<size_t>(hi - lo), 0.0);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) {
          double c = coef[static_cast<size_t>(n * M + m)];
          const T* v = src[static_cast<size_t>(m)] + n * D;
          for (int64_t d = lo; d < hi; ++d) du[static_cast<size_t>(d - lo)] += c * v[d];
        }
      for (int64_t d = lo; d < hi; ++d) {
        if (dw) dw[d] = static_cast<T>(du[static_cast<size_t>(d - lo)] * pn[d]);
        if (dn) dn[d] = static_cast<T>(du[static_cast<size_t>(d - lo)] * pw[d]);
      }
    });
  });
}

}  // namespace moetrain::cpu
