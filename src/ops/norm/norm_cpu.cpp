// CPU kernels of the norm family. Rows run in parallel; the weight and bias
// gradients (sums over rows) give each thread a range of columns and add rows in
// order, so every result is independent of the thread count.
#include <cmath>
#include <initializer_list>
#include <vector>

#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_rows.h"
#include "ops/common/bf16_widen.h"
#include "ops/common/math.h"
#include "ops/norm/norm_kernels.h"

namespace moetrain::cpu {

namespace {
constexpr int64_t kRowGrain = 8;
constexpr int64_t kColGrain = 32;

// s[j] = σ(z[j]) for a row, as the sigmoid op computes it, in the cpu::vector_isa()
// copy (run_vector_isa), so exp_approx runs vectorised.
template <class T>
inline void sigmoid_row_range(T* __restrict s, const T* __restrict z, int64_t n) {
  for (int64_t j = 0; j < n; ++j) s[j] = sigmoid_of(z[j]);
}
template <class T>
void sigmoid_row(T* s, const T* z, int64_t n) {
  run_vector_isa([](auto... a) { sigmoid_row_range<T>(a...); }, s, z, n);
}

// dw[j] = sum_r dy[r, j] * xhat(r, j), db[j] = sum_r dy[r, j] (column-owned).
// dy of type D, dw and db of type O: f32 or f64 (both the kernel's T), or bf16 in the
// bf16 paths, which read each bf16 dy widened and round each sum as the widening
// route does (ops/common/bf16_rows.h: widened_value, store_rounded).
template <class O, class D, class XHat>
void param_grads(O* dw, O* db, const D* dy, int64_t rows, int64_t n, XHat xhat) {
  parallel_for(n, kColGrain, [&](int64_t c0, int64_t c1) {
    std::vector<double> aw(static_cast<size_t>(c1 - c0), 0.0), ab(static_cast<size_t>(c1 - c0), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const D* g = dy + r * n;
      for (int64_t j = c0; j < c1; ++j) {
        if (dw) aw[static_cast<size_t>(j - c0)] += static_cast<double>(widened_value(g[j])) * xhat(r, j);
        if (db) ab[static_cast<size_t>(j - c0)] += widened_value(g[j]);
      }
    }
    for (int64_t j = c0; j < c1; ++j) {
      if (dw) store_rounded(dw[j], aw[static_cast<size_t>(j - c0)]);
      if (db) store_rounded(db[j], ab[static_cast<size_t>(j - c0)]);
    }
  });
}
}  // namespace

namespace {
// LayerNorm rows [lo, hi) of x [rows, n], in the cpu::vector_isa() copy. The mean and
// the variance (about the mean) are summed in double in kLanes lanes (math.h), a fixed
// order; y = (x - mean) rstd w + b in T (w, b: null for none).
template <class T>
inline void layer_norm_rows(T* __restrict y, T* __restrict mean, T* __restrict rstd, const T* __restrict x,
                            const T* __restrict w, const T* __restrict b, int64_t n, double eps, int64_t lo,
                            int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const T* xr = x + r * n;
    const double mu = sum_of(xr, n) / static_cast<double>(n);
    double acc[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      for (int k = 0; k < kLanes; ++k) {
        const double d = static_cast<double>(xr[j + k]) - mu;
        acc[k] += d * d;
      }
    double var = 0;
    for (; j < n; ++j) var += (static_cast<double>(xr[j]) - mu) * (static_cast<double>(xr[j]) - mu);
    for (int k = 0; k < kLanes; ++k) var += acc[k];
    const double rs = 1.0 / std::sqrt(var / static_cast<double>(n) + eps);
    mean[r] = static_cast<T>(mu);
    rstd[r] = static_cast<T>(rs);
    const T m = static_cast<T>(mu), s = static_cast<T>(rs);
    T* yr = y + r * n;
    if (w && b)
      for (int64_t c = 0; c < n; ++c) yr[c] = (xr[c] - m) * s * w[c] + b[c];
    else
      for (int64_t c = 0; c < n; ++c) yr[c] = (xr[c] - m) * s * (w ? w[c] : T(1)) + (b ? b[c] : T(0));
  }
}

// LayerNorm's dx for rows [lo, hi): with x̂ = (x - mean) rstd and g = dy w,
// dx = rstd (g - mean(g) - x̂ mean(g x̂)); the two means summed in double in kLanes
// lanes, the rest in T.
template <class T>
inline void layer_norm_backward_rows(T* __restrict dx, const T* __restrict dy, const T* __restrict x,
                                     const T* __restrict w, const T* __restrict mean, const T* __restrict rstd,
                                     int64_t n, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const T* xr = x + r * n;
    const T* gr = dy + r * n;
    const T m = mean[r], s = rstd[r];
    double ag[kLanes] = {}, agx[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      for (int k = 0; k < kLanes; ++k) {
        const T g = gr[j + k] * (w ? w[j + k] : T(1));
        ag[k] += static_cast<double>(g);
        agx[k] += static_cast<double>(g * ((xr[j + k] - m) * s));
      }
    double sum_g = 0, sum_gx = 0;
    for (; j < n; ++j) {
      const T g = gr[j] * (w ? w[j] : T(1));
      sum_g += static_cast<double>(g);
      sum_gx += static_cast<double>(g * ((xr[j] - m) * s));
    }
    for (int k = 0; k < kLanes; ++k) {
      sum_g += ag[k];
      sum_gx += agx[k];
    }
    const T mg = static_cast<T>(sum_g / static_cast<double>(n)), mgx = static_cast<T>(sum_gx / static_cast<double>(n));
    T* dr = dx + r * n;
    for (int64_t c = 0; c < n; ++c) {
      const T g = gr[c] * (w ? w[c] : T(1));
      dr[c] = s * (g - mg - (xr[c] - m) * s * mgx);
    }
  }
}

// LayerNorm's dw[j] = Σ_r dy[r, j] x̂[r, j], db[j] = Σ_r dy[r, j] for j in [c0, c1),
// rows in order, in double (column-owned: independent of the thread count).
// T: the statistics' type; S: dy's, x's, dw's and db's (T, or bf16 in the bf16 path,
// which reads each value widened and rounds each sum once, as the widening route).
template <class T, class S = T>
inline void layer_norm_param_grads(S* __restrict dw, S* __restrict db, const S* __restrict dy, const S* __restrict x,
                                   const T* __restrict mean, const T* __restrict rstd, int64_t rows, int64_t n,
                                   int64_t c0, int64_t c1) {
  constexpr int64_t kBlock = 256;
  double aw[kBlock], ab[kBlock];
  for (int64_t j0 = c0; j0 < c1; j0 += kBlock) {
    const int64_t wd = std::min(kBlock, c1 - j0);
    for (int64_t j = 0; j < wd; ++j) aw[j] = ab[j] = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const S* g = dy + r * n + j0;
      const S* xr = x + r * n + j0;
      const double mu = mean[r], rs = rstd[r];
      for (int64_t j = 0; j < wd; ++j) {
        const double gj = widened_value(g[j]);
        aw[j] += gj * ((static_cast<double>(widened_value(xr[j])) - mu) * rs);
        ab[j] += gj;
      }
    }
    for (int64_t j = 0; j < wd; ++j) {
      if constexpr (std::is_same_v<S, T>) {
        if (dw) dw[j0 + j] = static_cast<T>(aw[j]);
        if (db) db[j0 + j] = static_cast<T>(ab[j]);
      } else {
        if (dw) store_rounded(dw[j0 + j], aw[j]);
        if (db) store_rounded(db[j0 + j], ab[j]);
      }
    }
  }
}

// The fused add + LayerNorm, rows [lo, hi): h = x + d in T, then layer_norm_rows on
// that row while it is in cache: the unfused add then layer_norm, bit for bit.
template <class T>
inline void add_layer_norm_rows(T* __restrict h, T* __restrict y, T* __restrict mean, T* __restrict rstd,
                                const T* __restrict x, const T* __restrict d, const T* __restrict w,
                                const T* __restrict b, int64_t n, double eps, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    T* hr = h + r * n;
    const T *xr = x + r * n, *dr = d + r * n;
    for (int64_t c = 0; c < n; ++c) hr[c] = xr[c] + dr[c];
    layer_norm_rows<T>(y, mean, rstd, h, w, b, n, eps, r, r + 1);
  }
}

// Its backward, rows [lo, hi): LayerNorm's dx at h (layer_norm_backward_rows), then
// + grad_h in T: the sum the autograd engine forms for h's two uses, bit for bit
// (one addition of two terms, which commutes).
template <class T>
inline void add_layer_norm_backward_rows(T* __restrict dx, const T* __restrict grad_h, const T* __restrict dy,
                                         const T* __restrict h, const T* __restrict w, const T* __restrict mean,
                                         const T* __restrict rstd, int64_t n, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    layer_norm_backward_rows<T>(dx, dy, h, w, mean, rstd, n, r, r + 1);
    T* dr = dx + r * n;
    const T* gr = grad_h + r * n;
    for (int64_t c = 0; c < n; ++c) dr[c] = dr[c] + gr[c];
  }
}

// One row of RMSNorm / L2 norm (scaled_norm_forward): rstd in double, y = x rstd w,
// times gate[j] (σ(z), null for none).
template <class T>
void scaled_norm_row(T* yr, T& rstd, const T* xr, const T* pw, const T* gate, int64_t n, double scale, double eps) {
  double ss = 0;
  for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(xr[j]) * xr[j];
  double rs = 1.0 / std::sqrt(ss * scale + eps);
  rstd = static_cast<T>(rs);
  if (gate) {
    for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(xr[j] * rs * (pw ? pw[j] : T(1))) * gate[j];
  } else {
    for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(xr[j] * rs * (pw ? pw[j] : T(1)));
  }
}

// dx of one row of the scaled norm for the (gated) upstream gradient gr: with
// x̂ = x r and g = gr w, dx = r (g - x̂ scale Σ_j g_j x̂_j), the dot in double.
template <class T>
void scaled_norm_dx_row(T* dr, const T* gr, const T* xr, const T* pw, double rs, int64_t n, double scale) {
  double dot = 0;
  for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(gr[j]) * (pw ? pw[j] : T(1)) * xr[j] * rs;
  for (int64_t j = 0; j < n; ++j) {
    double g = static_cast<double>(gr[j]) * (pw ? pw[j] : T(1));
    dr[j] = static_cast<T>(rs * (g - xr[j] * rs * scale * dot));
  }
}
}  // namespace

// LayerNorm and the fused add + LayerNorm with bf16 x (GPT-2's norms in bf16;
// ops/common/bf16_rows.h): each row of every bf16 operand widened into per-thread f32
// rows (xf, ...), the f32 row code above on them in the same cpu::vector_isa() copy,
// each bf16 output row rounded once; mean and rstd f32 (stats_dtype). The bits of
// cpu::run_kernel's whole-tensor widening, without its f32 copies of whole tensors.
namespace {
inline void layer_norm_rows_bf16(bf16* __restrict y, float* __restrict mean, float* __restrict rstd,
                                 const bf16* __restrict x, const float* __restrict w, const float* __restrict b,
                                 int64_t n, double eps, int64_t lo, int64_t hi, float* __restrict xf,
                                 float* __restrict yf) {
  for (int64_t r = lo; r < hi; ++r) {
    widen_bf16_row(xf, x + r * n, n);
    layer_norm_rows<float>(yf, mean + r, rstd + r, xf, w, b, n, eps, 0, 1);
    round_bf16_row(y + r * n, yf, n);
  }
}

inline void add_layer_norm_rows_bf16(bf16* __restrict h, bf16* __restrict y, float* __restrict mean,
                                     float* __restrict rstd, const bf16* __restrict x, const bf16* __restrict d,
                                     const float* __restrict w, const float* __restrict b, int64_t n, double eps,
                                     int64_t lo, int64_t hi, float* __restrict xf, float* __restrict df,
                                     float* __restrict hf, float* __restrict yf) {
  for (int64_t r = lo; r < hi; ++r) {
    widen_bf16_row(xf, x + r * n, n);
    widen_bf16_row(df, d + r * n, n);
    add_layer_norm_rows<float>(hf, yf, mean + r, rstd + r, xf, df, w, b, n, eps, 0, 1);
    round_bf16_row(h + r * n, hf, n);
    round_bf16_row(y + r * n, yf, n);
  }
}

// dx rows [lo, hi) of LayerNorm (grad_h null) or of the fused add + LayerNorm (x is h,
// grad_h its upstream gradient, added after the norm's dx as the f32 kernel does).
inline void layer_norm_backward_rows_bf16(bf16* __restrict dx, const bf16* __restrict grad_h,
                                          const bf16* __restrict dy, const bf16* __restrict x,
                                          const float* __restrict w, const float* __restrict mean,
                                          const float* __restrict rstd, int64_t n, int64_t lo, int64_t hi,
                                          float* __restrict xf, float* __restrict dyf, float* __restrict ghf,
                                          float* __restrict dxf) {
  for (int64_t r = lo; r < hi; ++r) {
    widen_bf16_row(xf, x + r * n, n);
    widen_bf16_row(dyf, dy + r * n, n);
    if (grad_h) {
      widen_bf16_row(ghf, grad_h + r * n, n);
      add_layer_norm_backward_rows<float>(dxf, ghf, dyf, xf, w, mean + r, rstd + r, n, 0, 1);
    } else {
      layer_norm_backward_rows<float>(dxf, dyf, xf, w, mean + r, rstd + r, n, 0, 1);
    }
    round_bf16_row(dx + r * n, dxf, n);
  }
}

void check_layer_norm_bf16(const char* op, std::initializer_list<const Tensor*> bf16s, const Tensor& mean,
                           const Tensor& rstd) {
  bool ok = mean.dtype() == DType::f32 && rstd.dtype() == DType::f32;
  for (const Tensor* t : bf16s) ok = ok && (!t || !t->defined() || t->dtype() == DType::bf16);
  MT_CHECK(ok, "{}: bf16 x needs bf16 tensors and f32 statistics; mean {}, rstd {}", op, describe(mean),
           describe(rstd));
}

void layer_norm_forward_bf16(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w,
                             const Tensor& b, double eps) {
  check_layer_norm_bf16("layer_norm_forward", {&y, &w, &b}, mean, rstd);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  std::vector<float> wbuf, bbuf;
  const float* pw = f32_operand(w, wbuf);
  const float* pb = f32_operand(b, bbuf);
  const bf16* px = x.data<bf16>();
  bf16* py = y.data<bf16>();
  float *pm = mean.data<float>(), *pr = rstd.data<float>();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(static_cast<size_t>(2 * n));
    run_vector_isa([](auto... a) { layer_norm_rows_bf16(a...); }, py, pm, pr, px, pw, pb, n, eps, lo, hi,
                   buf.data(), buf.data() + n);
  });
}

void add_layer_norm_forward_bf16(Tensor& h, Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x,
                                 const Tensor& d, const Tensor& w, const Tensor& b, double eps) {
  check_layer_norm_bf16("add_layer_norm_forward", {&h, &y, &d, &w, &b}, mean, rstd);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  std::vector<float> wbuf, bbuf;
  const float* pw = f32_operand(w, wbuf);
  const float* pb = f32_operand(b, bbuf);
  const bf16 *px = x.data<bf16>(), *pd = d.data<bf16>();
  bf16 *ph = h.data<bf16>(), *py = y.data<bf16>();
  float *pm = mean.data<float>(), *pr = rstd.data<float>();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(static_cast<size_t>(4 * n));
    float* f = buf.data();
    run_vector_isa([](auto... a) { add_layer_norm_rows_bf16(a...); }, ph, py, pm, pr, px, pd, pw, pb, n, eps, lo,
                   hi, f, f + n, f + 2 * n, f + 3 * n);
  });
}

// LayerNorm's backward (grad_h undefined) or the fused add + LayerNorm's (x is h).
void layer_norm_backward_bf16(const char* op, Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_h,
                              const Tensor& grad_y, const Tensor& x, const Tensor& w, const Tensor& mean,
                              const Tensor& rstd) {
  check_layer_norm_bf16(op, {&grad_x, grad_w, grad_b, &grad_h, &grad_y, &w}, mean, rstd);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  std::vector<float> wbuf;
  const float* pw = f32_operand(w, wbuf);
  const bf16 *px = x.data<bf16>(), *dy = grad_y.data<bf16>();
  const bf16* gh = grad_h.defined() ? grad_h.data<bf16>() : nullptr;
  const float *pm = mean.data<float>(), *pr = rstd.data<float>();
  bf16* dx = grad_x.data<bf16>();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(static_cast<size_t>(4 * n));
    float* f = buf.data();
    run_vector_isa([](auto... a) { layer_norm_backward_rows_bf16(a...); }, dx, gh, dy, px, pw, pm, pr, n, lo, hi, f,
                   f + n, f + 2 * n, f + 3 * n);
  });
  if (grad_w || grad_b) {
    bf16* dw = grad_w ? grad_w->data<bf16>() : nullptr;
    bf16* db = grad_b ? grad_b->data<bf16>() : nullptr;
    parallel_for(n, kColGrain, [&](int64_t c0, int64_t c1) {
      run_vector_isa([](auto... a) { layer_norm_param_grads<float, bf16>(a...); }, dw, db, dy, px, pm, pr, rows, n,
                     c0, c1);
    });
  }
}
}  // namespace

void layer_norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                        double eps) {
  if (x.dtype() == DType::bf16) return layer_norm_forward_bf16(y, mean, rstd, x, w, b, eps);
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
      run_vector_isa([](auto... a) { layer_norm_rows<T>(a...); }, py, pm, pr, px, pw, pb, n, eps, lo, hi);
    });
  });
}

void layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_y, const Tensor& x,
                         const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  if (x.dtype() == DType::bf16)
    return layer_norm_backward_bf16("layer_norm_backward", grad_x, grad_w, grad_b, Tensor(), grad_y, x, w, mean, rstd);
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
      run_vector_isa([](auto... a) { layer_norm_backward_rows<T>(a...); }, dx, dy, px, pw, pm, pr, n, lo, hi);
    });
    if (grad_w || grad_b) {
      T* dw = grad_w ? grad_w->data<T>() : nullptr;
      T* db = grad_b ? grad_b->data<T>() : nullptr;
      parallel_for(n, kColGrain, [&](int64_t c0, int64_t c1) {
        run_vector_isa([](auto... a) { layer_norm_param_grads<T>(a...); }, dw, db, dy, px, pm, pr, rows, n, c0, c1);
      });
    }
  });
}

// bf16 x (the scaled norms' bf16 paths, ops/common/bf16_rows.h): each row of every
// bf16 operand widened into a per-thread f32 buffer, the f32 code above on it, each
// bf16 output row rounded once: the bits of cpu::run_kernel's whole-tensor widening.
// The statistics (rstd) are f32 as for any bf16 x; a bf16 weight is widened once.
namespace {
void scaled_norm_forward_bf16(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& z,
                              double scale, double eps) {
  MT_CHECK(y.dtype() == DType::bf16 && rstd.dtype() == DType::f32 && (!z.defined() || z.dtype() == DType::bf16),
           "scaled_norm_forward: bf16 x {} with y {}, rstd {}, gate {}", describe(x), describe(y), describe(rstd),
           describe(z));
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  std::vector<float> wbuf;
  const float* pw = f32_operand(w, wbuf);
  const bf16* px = x.data<bf16>();
  const bf16* pz = z.defined() ? z.data<bf16>() : nullptr;
  bf16* py = y.data<bf16>();
  float* pr = rstd.data<float>();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    const size_t width = static_cast<size_t>(n);
    std::vector<float> xf(width), yf(width), zf(pz ? width : 0), gate(pz ? width : 0);
    for (int64_t r = lo; r < hi; ++r) {
      widen_bf16_row(xf.data(), px + r * n, n);
      if (pz) {
        widen_bf16_row(zf.data(), pz + r * n, n);
        sigmoid_row(gate.data(), zf.data(), n);
      }
      scaled_norm_row(yf.data(), pr[r], xf.data(), pw, pz ? gate.data() : nullptr, n, scale, eps);
      round_bf16_row(py + r * n, yf.data(), n);
    }
  });
}

void scaled_norm_backward_bf16(Tensor& grad_x, Tensor* grad_w, Tensor* grad_z, const Tensor& grad_y, const Tensor& x,
                               const Tensor& w, const Tensor& z, const Tensor& rstd, double scale) {
  MT_CHECK(grad_x.dtype() == DType::bf16 && grad_y.dtype() == DType::bf16 && rstd.dtype() == DType::f32 &&
               (!z.defined() || z.dtype() == DType::bf16) && (!grad_z || grad_z->dtype() == DType::bf16) &&
               (!grad_w || grad_w->dtype() == DType::bf16),
           "scaled_norm_backward: bf16 x {} with grad_x {}, grad_y {}, rstd {}, gate {}", describe(x),
           describe(grad_x), describe(grad_y), describe(rstd), describe(z));
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  std::vector<float> wbuf;
  const float* pw = f32_operand(w, wbuf);
  const bf16* px = x.data<bf16>();
  const bf16* pz = z.defined() ? z.data<bf16>() : nullptr;
  const bf16* dy = grad_y.data<bf16>();
  const float* pr = rstd.data<float>();
  bf16* dx = grad_x.data<bf16>();
  bf16* dz = grad_z ? grad_z->data<bf16>() : nullptr;
  // With a gate, dy' = dy σ(z) in f32 (as the f32 kernel keeps it) for the weight gradient.
  Tensor gated = pz ? empty({rows, n}, DType::f32) : Tensor();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    const size_t width = static_cast<size_t>(n);
    std::vector<float> xf(width), dyf(width), dxf(width), zf(pz ? width : 0), sig(pz ? width : 0),
        dzf(dz ? width : 0);
    for (int64_t r = lo; r < hi; ++r) {
      widen_bf16_row(xf.data(), px + r * n, n);
      widen_bf16_row(dyf.data(), dy + r * n, n);
      const float* gr = dyf.data();
      if (pz) {
        widen_bf16_row(zf.data(), pz + r * n, n);
        sigmoid_row(sig.data(), zf.data(), n);
        float* g = gated.data<float>() + r * n;
        for (int64_t j = 0; j < n; ++j) g[j] = dyf[static_cast<size_t>(j)] * sig[static_cast<size_t>(j)];
        gr = g;
      }
      const double rs = pr[r];
      scaled_norm_dx_row(dxf.data(), gr, xf.data(), pw, rs, n, scale);
      round_bf16_row(dx + r * n, dxf.data(), n);
      if (dz) {
        for (int64_t j = 0; j < n; ++j) {
          const size_t u = static_cast<size_t>(j);
          const float s = sig[u], h = static_cast<float>(xf[u] * rs) * (pw ? pw[j] : 1.0f);
          dzf[u] = dyf[u] * h * s * (1.0f - s);
        }
        round_bf16_row(dz + r * n, dzf.data(), n);
      }
    }
  });
  if (grad_w) {
    auto xhat = [&](int64_t r, int64_t j) { return static_cast<double>(px[r * n + j].to_float()) * pr[r]; };
    if (pz)
      param_grads(grad_w->data<bf16>(), static_cast<bf16*>(nullptr), gated.data<float>(), rows, n, xhat);
    else
      param_grads(grad_w->data<bf16>(), static_cast<bf16*>(nullptr), dy, rows, n, xhat);
  }
}

void add_scaled_norm_forward_bf16(Tensor& h, Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& d,
                                  const Tensor& w, double scale, double eps) {
  MT_CHECK(h.dtype() == DType::bf16 && y.dtype() == DType::bf16 && d.dtype() == DType::bf16 &&
               rstd.dtype() == DType::f32,
           "add_scaled_norm_forward: bf16 x {} with d {}, h {}, y {}, rstd {}", describe(x), describe(d), describe(h),
           describe(y), describe(rstd));
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  std::vector<float> wbuf;
  const float* pw = f32_operand(w, wbuf);
  const bf16 *px = x.data<bf16>(), *pd = d.data<bf16>();
  bf16 *ph = h.data<bf16>(), *py = y.data<bf16>();
  float* pr = rstd.data<float>();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    const size_t width = static_cast<size_t>(n);
    std::vector<float> xf(width), df(width), hf(width), yf(width);
    for (int64_t r = lo; r < hi; ++r) {
      widen_bf16_row(xf.data(), px + r * n, n);
      widen_bf16_row(df.data(), pd + r * n, n);
      for (size_t c = 0; c < width; ++c) hf[c] = xf[c] + df[c];
      // The norm of the f32 sum, as the widened kernel computes it; h rounded after.
      scaled_norm_row(yf.data(), pr[r], hf.data(), pw, static_cast<const float*>(nullptr), n, scale, eps);
      round_bf16_row(ph + r * n, hf.data(), n);
      round_bf16_row(py + r * n, yf.data(), n);
    }
  });
}

void add_scaled_norm_backward_bf16(Tensor& grad_x, Tensor* grad_w, const Tensor& grad_h, const Tensor& grad_y,
                                   const Tensor& h, const Tensor& w, const Tensor& rstd, double scale) {
  MT_CHECK(grad_x.dtype() == DType::bf16 && grad_h.dtype() == DType::bf16 && grad_y.dtype() == DType::bf16 &&
               rstd.dtype() == DType::f32 && (!grad_w || grad_w->dtype() == DType::bf16),
           "add_scaled_norm_backward: bf16 h {} with grad_x {}, grad_h {}, grad_y {}, rstd {}", describe(h),
           describe(grad_x), describe(grad_h), describe(grad_y), describe(rstd));
  const int64_t n = h.size(-1), rows = h.numel() / std::max<int64_t>(n, 1);
  std::vector<float> wbuf;
  const float* pw = f32_operand(w, wbuf);
  const bf16 *ph = h.data<bf16>(), *dy = grad_y.data<bf16>(), *gh = grad_h.data<bf16>();
  const float* pr = rstd.data<float>();
  bf16* dx = grad_x.data<bf16>();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    const size_t width = static_cast<size_t>(n);
    std::vector<float> hf(width), dyf(width), ghf(width), dxf(width);
    for (int64_t r = lo; r < hi; ++r) {
      widen_bf16_row(hf.data(), ph + r * n, n);
      widen_bf16_row(dyf.data(), dy + r * n, n);
      widen_bf16_row(ghf.data(), gh + r * n, n);
      scaled_norm_dx_row(dxf.data(), dyf.data(), hf.data(), pw, static_cast<double>(pr[r]), n, scale);
      for (size_t c = 0; c < width; ++c) dxf[c] = dxf[c] + ghf[c];
      round_bf16_row(dx + r * n, dxf.data(), n);
    }
  });
  if (grad_w)
    param_grads(grad_w->data<bf16>(), static_cast<bf16*>(nullptr), dy, rows, n,
                [&](int64_t r, int64_t j) { return static_cast<double>(ph[r * n + j].to_float()) * pr[r]; });
}
}  // namespace

void scaled_norm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& z, double scale,
                         double eps) {
  if (x.dtype() == DType::bf16) return scaled_norm_forward_bf16(y, rstd, x, w, z, scale, eps);
  if (cpu_is_bf16(z)) {  // a bf16 gate under f32 x (ops/norm/norm.cpp): read widened, as cpu::run_kernel did
    const Tensor zf = widen_bf16(z);
    return scaled_norm_forward(y, rstd, x, w, zf, scale, eps);
  }
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
        if (pz) sigmoid_row(gate.data(), pz + r * n, n);
        scaled_norm_row(py + r * n, pr[r], px + r * n, pw, pz ? gate.data() : nullptr, n, scale, eps);
      }
    });
  });
}

// With x̂ = x r, g = dy' ⊙ w and dy' = dy σ(z) (dy without a gate):
// dx = r (g - x̂ · scale · Σ_j g_j x̂_j), the RMSNorm formula for scale = 1/n and the
// L2 formula for scale = 1 (there x̂ = y, w = 1); dz = dy x̂ w σ(z)(1 - σ(z)).
void scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_z, const Tensor& grad_y, const Tensor& x,
                          const Tensor& w, const Tensor& z, const Tensor& rstd, double scale) {
  if (x.dtype() == DType::bf16) return scaled_norm_backward_bf16(grad_x, grad_w, grad_z, grad_y, x, w, z, rstd, scale);
  if (cpu_is_bf16(z)) {  // a bf16 gate under f32 x: z widened, dz rounded once, as cpu::run_kernel did
    const Tensor zf = widen_bf16(z);
    Tensor dzf = grad_z ? empty(grad_z->shape(), DType::f32) : Tensor();
    scaled_norm_backward(grad_x, grad_w, grad_z ? &dzf : nullptr, grad_y, x, w, zf, rstd, scale);
    if (grad_z) round_into_bf16(*grad_z, dzf);
    return;
  }
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
        const double rs = pr[r];
        scaled_norm_dx_row(dx + r * n, dyg + r * n, xr, pw, rs, n, scale);
        if (dz)
          for (int64_t j = 0; j < n; ++j) {
            const T s = sig[static_cast<size_t>(j)], h = static_cast<T>(xr[j] * rs) * (pw ? pw[j] : T(1));
            dz[r * n + j] = dy[r * n + j] * h * s * (T(1) - s);
          }
      }
    });
    if (grad_w)
      param_grads(grad_w->data<T>(), static_cast<T*>(nullptr), dyg, rows, n,
                     [&](int64_t r, int64_t j) { return static_cast<double>(px[r * n + j]) * pr[r]; });
  });
}

void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& d,
                            const Tensor& w, const Tensor& b, double eps) {
  if (x.dtype() == DType::bf16) return add_layer_norm_forward_bf16(h, y, mean, rstd, x, d, w, b, eps);
  dispatch_float(x.dtype(), "add_layer_norm", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T *px = x.data<T>(), *pd = d.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T* pb = b.defined() ? b.data<T>() : nullptr;
    T *ph = h.data<T>(), *py = y.data<T>(), *pm = mean.data<T>(), *pr = rstd.data<T>();
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      run_vector_isa([](auto... a) { add_layer_norm_rows<T>(a...); }, ph, py, pm, pr, px, pd, pw, pb, n, eps, lo,
                     hi);
    });
  });
}

void add_layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_h,
                             const Tensor& grad_y, const Tensor& h, const Tensor& w, const Tensor& mean,
                             const Tensor& rstd) {
  if (h.dtype() == DType::bf16)
    return layer_norm_backward_bf16("add_layer_norm_backward", grad_x, grad_w, grad_b, grad_h, grad_y, h, w, mean,
                                    rstd);
  dispatch_float(h.dtype(), "add_layer_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = h.size(-1), rows = h.numel() / std::max<int64_t>(n, 1);
    const T* ph = h.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T *dy = grad_y.data<T>(), *gh = grad_h.data<T>(), *pm = mean.data<T>(), *pr = rstd.data<T>();
    T* dx = grad_x.data<T>();
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      run_vector_isa([](auto... a) { add_layer_norm_backward_rows<T>(a...); }, dx, gh, dy, ph, pw, pm, pr, n, lo,
                     hi);
    });
    if (grad_w || grad_b) {
      T* dw = grad_w ? grad_w->data<T>() : nullptr;
      T* db = grad_b ? grad_b->data<T>() : nullptr;
      parallel_for(n, kColGrain, [&](int64_t c0, int64_t c1) {
        run_vector_isa([](auto... a) { layer_norm_param_grads<T>(a...); }, dw, db, dy, ph, pm, pr, rows, n, c0, c1);
      });
    }
  });
}

void add_scaled_norm_forward(Tensor& h, Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& d, const Tensor& w,
                             double scale, double eps) {
  if (x.dtype() == DType::bf16) return add_scaled_norm_forward_bf16(h, y, rstd, x, d, w, scale, eps);
  dispatch_float(x.dtype(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T *px = x.data<T>(), *pd = d.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    T *ph = h.data<T>(), *py = y.data<T>(), *pr = rstd.data<T>();
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        T* hr = ph + r * n;
        for (int64_t c = 0; c < n; ++c) hr[c] = px[r * n + c] + pd[r * n + c];
        scaled_norm_row(py + r * n, pr[r], hr, pw, static_cast<const T*>(nullptr), n, scale, eps);
      }
    });
  });
}

void add_scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, const Tensor& grad_h, const Tensor& grad_y,
                              const Tensor& h, const Tensor& w, const Tensor& rstd, double scale) {
  if (h.dtype() == DType::bf16) return add_scaled_norm_backward_bf16(grad_x, grad_w, grad_h, grad_y, h, w, rstd, scale);
  dispatch_float(h.dtype(), "add_rms_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = h.size(-1), rows = h.numel() / std::max<int64_t>(n, 1);
    const T* ph = h.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T *dy = grad_y.data<T>(), *gh = grad_h.data<T>(), *pr = rstd.data<T>();
    T* dx = grad_x.data<T>();
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        T* dr = dx + r * n;
        scaled_norm_dx_row(dr, dy + r * n, ph + r * n, pw, static_cast<double>(pr[r]), n, scale);
        for (int64_t c = 0; c < n; ++c) dr[c] = dr[c] + gh[r * n + c];
      }
    });
    if (grad_w)
      param_grads(grad_w->data<T>(), static_cast<T*>(nullptr), dy, rows, n,
                     [&](int64_t r, int64_t j) { return static_cast<double>(ph[r * n + j]) * pr[r]; });
  });
}

}  // namespace moetrain::cpu
