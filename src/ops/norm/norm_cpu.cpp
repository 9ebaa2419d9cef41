// CPU kernels of the norm family. Rows run in parallel; the weight and bias
// gradients (sums over rows) give each thread a range of columns and add rows in
// order, so every result is independent of the thread count.
#include <cmath>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/math.h"
#include "ops/norm/norm_kernels.h"

namespace moetrain::cpu {

namespace {
constexpr int64_t kRowGrain = 8;
constexpr int64_t kColGrain = 32;

// s[j] = σ(z[j]) for a row, as the sigmoid op computes it; an AVX2 + FMA copy is
// picked by CPUID at load time (target_clones), so exp_approx runs vectorised.
template <class T>
__attribute__((target_clones("arch=x86-64-v3", "default"))) void sigmoid_row(T* __restrict s, const T* __restrict z,
                                                                             int64_t n) {
  for (int64_t j = 0; j < n; ++j) s[j] = sigmoid_of(z[j]);
}

// dw[j] = sum_r dy[r, j] * xhat(r, j), db[j] = sum_r dy[r, j] (column-owned).
template <class T, class XHat>
void param_grads(T* dw, T* db, const T* dy, int64_t rows, int64_t n, XHat xhat) {
  parallel_for(n, kColGrain, [&](int64_t c0, int64_t c1) {
    std::vector<double> aw(static_cast<size_t>(c1 - c0), 0.0), ab(static_cast<size_t>(c1 - c0), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = dy + r * n;
      for (int64_t j = c0; j < c1; ++j) {
        if (dw) aw[static_cast<size_t>(j - c0)] += static_cast<double>(g[j]) * xhat(r, j);
        if (db) ab[static_cast<size_t>(j - c0)] += g[j];
      }
    }
    for (int64_t j = c0; j < c1; ++j) {
      if (dw) dw[j] = static_cast<T>(aw[static_cast<size_t>(j - c0)]);
      if (db) db[j] = static_cast<T>(ab[static_cast<size_t>(j - c0)]);
    }
  });
}
}  // namespace

void layer_norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                        double eps) {
  dispatch_float(x.dtype(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T* px = x.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T* pb = b.defined() ? b.data<T>() : nullptr;
    T* py = y.data<T>();
    T* pm = mean.data<T>();
    T* pr = rstd.data<T>();
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = px + r * n;
        double s = 0;
        for (int64_t j = 0; j < n; ++j) s += xr[j];
        double mu = s / static_cast<double>(n), v = 0;
        for (int64_t j = 0; j < n; ++j) v += (xr[j] - mu) * (xr[j] - mu);
        double rs = 1.0 / std::sqrt(v / static_cast<double>(n) + eps);
        pm[r] = static_cast<T>(mu);
        pr[r] = static_cast<T>(rs);
        T* yr = py + r * n;
        for (int64_t j = 0; j < n; ++j) {
          double h = (xr[j] - mu) * rs;
          yr[j] = static_cast<T>(h * (pw ? pw[j] : T(1)) + (pb ? pb[j] : T(0)));
        }
      }
    });
  });
}

void layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_y, const Tensor& x,
                         const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  dispatch_float(x.dtype(), "layer_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T* px = x.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T* dy = grad_y.data<T>();
    const T* pm = mean.data<T>();
    const T* pr = rstd.data<T>();
    T* dx = grad_x.data<T>();
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = px + r * n;
        const T* gr = dy + r * n;
        double mu = pm[r], rs = pr[r], sum_g = 0, sum_gx = 0;
        for (int64_t j = 0; j < n; ++j) {
          double g = static_cast<double>(gr[j]) * (pw ? pw[j] : T(1));
          sum_g += g;
          sum_gx += g * (xr[j] - mu) * rs;
        }
        double mg = sum_g / static_cast<double>(n), mgx = sum_gx / static_cast<double>(n);
        T* dr = dx + r * n;
        for (int64_t j = 0; j < n; ++j) {
          double g = static_cast<double>(gr[j]) * (pw ? pw[j] : T(1));
          dr[j] = static_cast<T>(rs * (g - mg - (xr[j] - mu) * rs * mgx));
        }
      }
    });
    if (grad_w || grad_b)
      param_grads<T>(grad_w ? grad_w->data<T>() : nullptr, grad_b ? grad_b->data<T>() : nullptr, dy, rows, n,
                     [&](int64_t r, int64_t j) { return (static_cast<double>(px[r * n + j]) - pm[r]) * pr[r]; });
  });
}

void scaled_norm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& z, double scale,
                         double eps) {
  dispatch_float(x.dtype(), "norm", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T* px = x.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T* pz = z.defined() ? z.data<T>() : nullptr;
    T* py = y.data<T>();
    T* pr = rstd.data<T>();
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      std::vector<T> gate(pz ? static_cast<size_t>(n) : 0);
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = px + r * n;
        double ss = 0;
        for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(xr[j]) * xr[j];
        double rs = 1.0 / std::sqrt(ss * scale + eps);
        pr[r] = static_cast<T>(rs);
        T* yr = py + r * n;
        if (pz) {
          sigmoid_row(gate.data(), pz + r * n, n);
          for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(xr[j] * rs * (pw ? pw[j] : T(1))) * gate[j];
        } else {
          for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(xr[j] * rs * (pw ? pw[j] : T(1)));
        }
      }
    });
  });
}

// With x̂ = x r, g = dy' ⊙ w and dy' = dy σ(z) (dy without a gate):
// dx = r (g - x̂ · scale · Σ_j g_j x̂_j), the RMSNorm formula for scale = 1/n and the
// L2 formula for scale = 1 (there x̂ = y, w = 1); dz = dy x̂ w σ(z)(1 - σ(z)).
void scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_z, const Tensor& grad_y, const Tensor& x,
                          const Tensor& w, const Tensor& z, const Tensor& rstd, double scale) {
  dispatch_float(x.dtype(), "norm_backward", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T* px = x.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T* pz = z.defined() ? z.data<T>() : nullptr;
    const T* dy = grad_y.data<T>();
    const T* pr = rstd.data<T>();
    T* dx = grad_x.data<T>();
    T* dz = grad_z ? grad_z->data<T>() : nullptr;
    // With a gate, dy' = dy σ(z) is kept for the weight gradient.
    Tensor gated = pz ? empty({rows, n}, x.dtype()) : Tensor();  // uninitialised: each row thread writes its own
    const T* dyg = pz ? gated.data<T>() : dy;
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      std::vector<T> sig(pz ? static_cast<size_t>(n) : 0);
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = px + r * n;
        if (pz) {
          sigmoid_row(sig.data(), pz + r * n, n);
          T* gr = gated.data<T>() + r * n;
          for (int64_t j = 0; j < n; ++j) gr[j] = dy[r * n + j] * sig[static_cast<size_t>(j)];
        }
        const T* gr = dyg + r * n;
        double rs = pr[r], dot = 0;
        for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(gr[j]) * (pw ? pw[j] : T(1)) * xr[j] * rs;
        T* dr = dx + r * n;
        for (int64_t j = 0; j < n; ++j) {
          double g = static_cast<double>(gr[j]) * (pw ? pw[j] : T(1));
          dr[j] = static_cast<T>(rs * (g - xr[j] * rs * scale * dot));
        }
        if (dz)
          for (int64_t j = 0; j < n; ++j) {
            const T s = sig[static_cast<size_t>(j)], h = static_cast<T>(xr[j] * rs) * (pw ? pw[j] : T(1));
            dz[r * n + j] = dy[r * n + j] * h * s * (T(1) - s);
          }
      }
    });
    if (grad_w)
      param_grads<T>(grad_w->data<T>(), static_cast<T*>(nullptr), dyg, rows, n,
                     [&](int64_t r, int64_t j) { return static_cast<double>(px[r * n + j]) * pr[r]; });
  });
}

}  // namespace moetrain::cpu
