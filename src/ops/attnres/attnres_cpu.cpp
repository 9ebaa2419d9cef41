// AttnRes read kernels. Forward and the per-source gradients are parallel over
// tokens; the pseudo-query / norm gradients over the model dim (each thread owns
// a range of d and sums over tokens in order), so every result is independent
// of the thread count. Scores and softmax in double. bf16 sources (train.dtype
// bf16) are widened a token's rows at a time (attn_res_forward_bf16).
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/attnres/attnres_kernels.h"
#include "ops/common/bf16_rows.h"

namespace moetrain::cpu {

namespace {
constexpr int64_t kTokenGrain = 16;

// The values of a [D] vector (proj, norm) as T: exact for bf16 widened to f32.
template <class T>
std::vector<T> attn_res_values(const Tensor& t) {
  std::vector<T> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::bf16) {
    const bf16* p = t.data<bf16>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(p[i].to_float());
  } else {
    const T* p = t.data<T>();
    std::copy(p, p + out.size(), out.begin());
  }
  return out;
}

// Writes v (f32/f64 values) into t: as is, or rounded once to bf16.
template <class T>
void attn_res_store(Tensor& t, int64_t d, T v) {
  if (t.dtype() == DType::bf16) t.data<bf16>()[d] = bf16::from_float(static_cast<float>(v));
  else t.data<T>()[d] = v;
}

inline double attn_res_load(float x) { return x; }
inline double attn_res_load(double x) { return x; }
inline double attn_res_load(bf16 x) { return x.to_float(); }

// One token of the forward: src[m] its rows of the M sources, h its output row,
// a / r its M weights and reciprocal RMS; s: M doubles of scratch.
template <class T>
void attn_res_token(const T* const* src, T* hr, T* a_out, T* r_out, const T* u, int64_t M, int64_t D, double eps,
                    double* s) {
  double smax = -INFINITY;
  for (int64_t m = 0; m < M; ++m) {
    const T* v = src[m];
    double sq = 0, dot = 0;
    for (int64_t d = 0; d < D; ++d) {
      sq += static_cast<double>(v[d]) * v[d];
      dot += static_cast<double>(v[d]) * u[d];
    }
    double r = 1.0 / std::sqrt(sq / static_cast<double>(D) + eps);
    r_out[m] = static_cast<T>(r);
    s[m] = dot * r;
    smax = std::max(smax, s[m]);
  }
  double z = 0;
  for (int64_t m = 0; m < M; ++m) z += (s[m] = std::exp(s[m] - smax));
  for (int64_t d = 0; d < D; ++d) hr[d] = T(0);
  for (int64_t m = 0; m < M; ++m) {
    T a = static_cast<T>(s[m] / z);
    a_out[m] = a;
    const T* v = src[m];
    for (int64_t d = 0; d < D; ++d) hr[d] += a * v[d];
  }
}

// One token of the backward's first pass: g its gradient row, src / dsrc its source
// rows and their gradient rows (null: not needed), a / r its weights and reciprocal
// RMS; writes coef (M values). dp, s: M doubles of scratch.
template <class T>
void attn_res_token_backward(const T* g, const T* const* src, T* const* dsrc, const T* u, const T* a_n, const T* r_n,
                             T* coef, int64_t M, int64_t D, double* dp, double* s) {
  double mean_dp = 0;
  for (int64_t m = 0; m < M; ++m) {
    const T* v = src[m];
    double acc = 0, dot = 0;
    for (int64_t d = 0; d < D; ++d) {
      acc += static_cast<double>(g[d]) * v[d];
      dot += static_cast<double>(v[d]) * u[d];
    }
    dp[m] = acc;
    s[m] = dot * r_n[m];
    mean_dp += a_n[m] * acc;
  }
  for (int64_t m = 0; m < M; ++m) {
    double a = a_n[m], r = r_n[m];
    double ds = a * (dp[m] - mean_dp);
    coef[m] = static_cast<T>(ds * r);
    T* dv = dsrc[m];
    if (!dv) continue;
    const T* v = src[m];
    // dV_m = α_m dh + ds_m r_m (u − V_m r_m s_m / D)
    T ta = static_cast<T>(a), tc = static_cast<T>(ds * r), tk = static_cast<T>(r * s[m] / static_cast<double>(D));
    for (int64_t d = 0; d < D; ++d) dv[d] = ta * g[d] + tc * (u[d] - v[d] * tk);
  }
}

// The pseudo-query and norm gradients over d in [lo, hi): du_d = Σ_n Σ_m c[n,m] V_m[n,d],
// then dproj = du ⊙ norm, dnorm = du ⊙ proj. S: the sources' storage type.
template <class T, class S>
void attn_res_param_grads(Tensor* grad_proj, Tensor* grad_norm, const std::vector<const S*>& src, const T* coef,
                          const T* pw, const T* pn, int64_t N, int64_t M, int64_t D) {
  parallel_for(D, 8, [&](int64_t lo, int64_t hi) {
    std::vector<double> du(static_cast<size_t>(hi - lo), 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) {
        double c = coef[static_cast<size_t>(n * M + m)];
        const S* v = src[static_cast<size_t>(m)] + n * D;
        for (int64_t d = lo; d < hi; ++d) du[static_cast<size_t>(d - lo)] += c * attn_res_load(v[d]);
      }
    for (int64_t d = lo; d < hi; ++d) {
      if (grad_proj) attn_res_store(*grad_proj, d, static_cast<T>(du[static_cast<size_t>(d - lo)] * pn[d]));
      if (grad_norm) attn_res_store(*grad_norm, d, static_cast<T>(du[static_cast<size_t>(d - lo)] * pw[d]));
    }
  });
}

// bf16 sources, h and gradients (train.dtype bf16; alpha and rstd f32): each token's
// rows widened into per-thread f32 buffers, the f32 code above, each bf16 output row
// rounded once: the bits of cpu::run_kernel's widening without f32 copies of the M
// sources.
void attn_res_forward_bf16(Tensor& h, Tensor& alpha, Tensor& rstd, const std::vector<const Tensor*>& sources,
                           const Tensor& proj, const Tensor& norm, double eps) {
  MT_CHECK(alpha.dtype() == DType::f32 && rstd.dtype() == DType::f32,
           "attn_res: bf16 sources need f32 alpha and rstd; got {} and {}", alpha.dtype(), rstd.dtype());
  const int64_t M = static_cast<int64_t>(sources.size());
  const int64_t D = h.size(-1), N = h.numel() / std::max<int64_t>(D, 1);
  std::vector<const bf16*> src(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) src[static_cast<size_t>(m)] = sources[static_cast<size_t>(m)]->data<bf16>();
  const std::vector<float> pw = attn_res_values<float>(proj), pn = attn_res_values<float>(norm);
  std::vector<float> u(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) u[static_cast<size_t>(d)] = pw[static_cast<size_t>(d)] * pn[static_cast<size_t>(d)];
  bf16* ph = h.data<bf16>();
  float* pa = alpha.data<float>();
  float* pr = rstd.data<float>();
  parallel_for(N, kTokenGrain, [&](int64_t lo, int64_t hi) {
    std::vector<double> s(static_cast<size_t>(M));
    std::vector<float> rows(static_cast<size_t>(M * D)), hrow(static_cast<size_t>(D));
    std::vector<const float*> row_ptrs(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) row_ptrs[static_cast<size_t>(m)] = rows.data() + m * D;
    for (int64_t n = lo; n < hi; ++n) {
      for (int64_t m = 0; m < M; ++m) widen_bf16_row(rows.data() + m * D, src[static_cast<size_t>(m)] + n * D, D);
      attn_res_token<float>(row_ptrs.data(), hrow.data(), pa + n * M, pr + n * M, u.data(), M, D, eps, s.data());
      round_bf16_row(ph + n * D, hrow.data(), D);
    }
  });
}

void attn_res_backward_bf16(std::vector<Tensor>& grad_sources, Tensor* grad_proj, Tensor* grad_norm,
                            const Tensor& grad_h, const std::vector<const Tensor*>& sources, const Tensor& proj,
                            const Tensor& norm, const Tensor& alpha, const Tensor& rstd) {
  MT_CHECK(alpha.dtype() == DType::f32 && rstd.dtype() == DType::f32,
           "attn_res_backward: bf16 sources need f32 alpha and rstd; got {} and {}", alpha.dtype(), rstd.dtype());
  const int64_t M = static_cast<int64_t>(sources.size());
  const int64_t D = grad_h.size(-1), N = grad_h.numel() / std::max<int64_t>(D, 1);
  std::vector<const bf16*> src(static_cast<size_t>(M));
  std::vector<bf16*> dsrc(static_cast<size_t>(M), nullptr);
  for (int64_t m = 0; m < M; ++m) {
    src[static_cast<size_t>(m)] = sources[static_cast<size_t>(m)]->data<bf16>();
    if (grad_sources[static_cast<size_t>(m)].defined()) dsrc[static_cast<size_t>(m)] = grad_sources[static_cast<size_t>(m)].data<bf16>();
  }
  const std::vector<float> pw = attn_res_values<float>(proj), pn = attn_res_values<float>(norm);
  const float* pa = alpha.data<float>();
  const float* pr = rstd.data<float>();
  const bf16* dh = grad_h.data<bf16>();
  std::vector<float> u(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) u[static_cast<size_t>(d)] = pw[static_cast<size_t>(d)] * pn[static_cast<size_t>(d)];
  std::vector<float> coef(static_cast<size_t>(N * M));
  parallel_for(N, kTokenGrain, [&](int64_t lo, int64_t hi) {
    std::vector<double> dp(static_cast<size_t>(M)), s(static_cast<size_t>(M));
    std::vector<float> rows(static_cast<size_t>(M * D)), drows(static_cast<size_t>(M * D)), g(static_cast<size_t>(D));
    std::vector<const float*> row_ptrs(static_cast<size_t>(M));
    std::vector<float*> drow_ptrs(static_cast<size_t>(M), nullptr);
    for (int64_t m = 0; m < M; ++m) {
      row_ptrs[static_cast<size_t>(m)] = rows.data() + m * D;
      if (dsrc[static_cast<size_t>(m)]) drow_ptrs[static_cast<size_t>(m)] = drows.data() + m * D;
    }
    for (int64_t n = lo; n < hi; ++n) {
      widen_bf16_row(g.data(), dh + n * D, D);
      for (int64_t m = 0; m < M; ++m) widen_bf16_row(rows.data() + m * D, src[static_cast<size_t>(m)] + n * D, D);
      attn_res_token_backward<float>(g.data(), row_ptrs.data(), drow_ptrs.data(), u.data(), pa + n * M, pr + n * M,
                                     coef.data() + n * M, M, D, dp.data(), s.data());
      for (int64_t m = 0; m < M; ++m)
        if (bf16* dv = dsrc[static_cast<size_t>(m)]) round_bf16_row(dv + n * D, drows.data() + m * D, D);
    }
  });
  if (!grad_proj && !grad_norm) return;
  attn_res_param_grads<float, bf16>(grad_proj, grad_norm, src, coef.data(), pw.data(), pn.data(), N, M, D);
}

}  // namespace

void attn_res_forward(Tensor& h, Tensor& alpha, Tensor& rstd, const std::vector<const Tensor*>& sources,
                      const Tensor& proj, const Tensor& norm, double eps) {
  if (h.dtype() == DType::bf16) return attn_res_forward_bf16(h, alpha, rstd, sources, proj, norm, eps);
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
      std::vector<const T*> rows(static_cast<size_t>(M));
      for (int64_t n = lo; n < hi; ++n) {
        for (int64_t m = 0; m < M; ++m) rows[static_cast<size_t>(m)] = src[static_cast<size_t>(m)] + n * D;
        attn_res_token<T>(rows.data(), ph + n * D, pa + n * M, pr + n * M, u.data(), M, D, eps, s.data());
      }
    });
  });
}

void attn_res_backward(std::vector<Tensor>& grad_sources, Tensor* grad_proj, Tensor* grad_norm,
                       const Tensor& grad_h, const std::vector<const Tensor*>& sources, const Tensor& proj,
                       const Tensor& norm, const Tensor& alpha, const Tensor& rstd) {
  if (grad_h.dtype() == DType::bf16)
    return attn_res_backward_bf16(grad_sources, grad_proj, grad_norm, grad_h, sources, proj, norm, alpha, rstd);
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
      std::vector<const T*> rows(static_cast<size_t>(M));
      std::vector<T*> drows(static_cast<size_t>(M));
      for (int64_t n = lo; n < hi; ++n) {
        for (int64_t m = 0; m < M; ++m) {
          rows[static_cast<size_t>(m)] = src[static_cast<size_t>(m)] + n * D;
          drows[static_cast<size_t>(m)] = dsrc[static_cast<size_t>(m)] ? dsrc[static_cast<size_t>(m)] + n * D : nullptr;
        }
        attn_res_token_backward<T>(dh + n * D, rows.data(), drows.data(), u.data(), pa + n * M, pr + n * M,
                                   coef.data() + n * M, M, D, dp.data(), s.data());
      }
    });
    if (!grad_proj && !grad_norm) return;
    attn_res_param_grads<T, T>(grad_proj, grad_norm, src, coef.data(), pw, pn, N, M, D);
  });
}

}  // namespace moetrain::cpu
