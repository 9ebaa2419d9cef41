// CPU kernels of the linalg family: matmul through BLAS; linear with a bias (and
// GELU) as one GEMM and one vectorised pass, its backward as one pass (GELU's
// derivative and the bias gradient) and two GEMMs. bf16: the products through
// oneDNN's bf16 matmul with f32 accumulation (backend/cpu/onednn.h), the bias, GELU
// and bias-gradient passes in f32 on the f32 products, each bf16 output rounded once.
#include <algorithm>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/onednn.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_widen.h"
#include "ops/common/gelu.h"
#include "ops/linalg/linalg_kernels.h"

namespace moetrain::cpu {

namespace {

// bf16 x bf16 through oneDNN: C [m, n] (bf16 or f32) = op(A) op(B), row-major.
void linalg_bf16_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, const bf16* b,
                      int64_t ldb, void* c, DType c_type, int64_t ldc) {
  onednn::MatmulShape s;
  s.trans_a = ta, s.trans_b = tb, s.m = m, s.n = n, s.k = k, s.lda = lda, s.ldb = ldb, s.ldc = ldc;
  onednn::matmul(s, DType::bf16, a, b, c_type, c);
}

void matmul_forward_bf16(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  const int64_t m = out.size(-2), n = out.size(-1);
  const int64_t k = trans_a ? a.size(-2) : a.size(-1);
  onednn::MatmulShape s;
  s.trans_a = trans_a, s.trans_b = trans_b, s.n = n, s.k = k, s.lda = a.size(-1), s.ldb = b.size(-1), s.ldc = n;
  if (b.dim() == 2 && (a.dim() == 2 || !trans_a)) {
    s.m = a.dim() == 2 ? m : a.shape().numel(0, a.dim() - 1);  // all rows of a at once
  } else {
    s.m = m;
    s.batch = out.shape().numel(0, out.dim() - 2);
    s.stride_a = a.dim() == 2 ? 0 : a.size(-2) * a.size(-1);
    s.stride_b = b.dim() == 2 ? 0 : b.size(-2) * b.size(-1);
    s.stride_c = m * n;
  }
  onednn::matmul(s, DType::bf16, a.data<bf16>(), b.data<bf16>(), DType::bf16, out.data<bf16>());
}

}  // namespace

void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  if (a.dtype() == DType::bf16) return matmul_forward_bf16(out, a, b, trans_a, trans_b);
  dispatch_float(a.dtype(), "matmul", [&](auto tag) {
    using T = decltype(tag);
    int64_t m = out.size(-2), n = out.size(-1);
    int64_t k = trans_a ? a.size(-2) : a.size(-1);
    int64_t lda = a.size(-1), ldb = b.size(-1);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* pc = out.data<T>();
    if (b.dim() == 2 && (a.dim() == 2 || !trans_a)) {
      // All rows of a at once: [rows, K] x op(b).
      int64_t rows = a.dim() == 2 ? m : a.shape().numel(0, a.dim() - 1);
      gemm(trans_a, trans_b, rows, n, k, T(1), pa, lda, pb, ldb, T(0), pc, n);
      return;
    }
    int64_t batch = out.shape().numel(0, out.dim() - 2);
    int64_t a_step = a.dim() == 2 ? 0 : a.size(-2) * a.size(-1), c_step = m * n;
    int64_t b_step = b.dim() == 2 ? 0 : b.size(-2) * b.size(-1);
    auto one = [&](int64_t i) {
      gemm(trans_a, trans_b, m, n, k, T(1), pa + i * a_step, lda, pb + i * b_step, ldb, T(0), pc + i * c_step, n);
    };
    // Small matrices: one per thread (BLAS runs single-threaded inside); large: BLAS threads.
    if (m * n * k < (1 << 21)) {
      parallel_for(batch, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) one(i);
      });
    } else {
      for (int64_t i = 0; i < batch; ++i) one(i);
    }
  });
}

namespace {

// One pass over y [rows, n] after the GEMM: y += b (kGelu false), or z = y + b,
// y = gelu_tanh(z) (kGelu true). The elementwise add and gelu_tanh's arithmetic
// (ops/common/math.h), so the same bits as linear then gelu_tanh unfused.
template <class T, bool kGelu>
inline void bias_act_rows(T* __restrict y, T* __restrict z, const T* __restrict b, int64_t n, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    T* yr = y + r * n;
    if constexpr (kGelu) {
      T* zr = z + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const T v = yr[j] + b[j];
        zr[j] = v;
        yr[j] = gelu_tanh_of(v);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) yr[j] = yr[j] + b[j];
    }
  }
}

// Columns [lo, hi) of grad_z = grad_y (kGelu false: gz is grad_y itself, not written)
// or grad_y gelu_tanh'(z) (written to gz), and grad_b[j] = Σ_r grad_z[r, j] in double,
// rows in order: sum_to's order (elementwise_cpu.cpp), so the same bits.
template <class T, bool kGelu>
inline void bias_grad_columns(T* gz, T* __restrict gb, const T* gy, const T* __restrict z, int64_t rows, int64_t n,
                              int64_t lo, int64_t hi) {
  constexpr int64_t kBlock = 256;
  double acc[kBlock];
  for (int64_t j0 = lo; j0 < hi; j0 += kBlock) {
    const int64_t w = std::min(kBlock, hi - j0);
    for (int64_t j = 0; j < w; ++j) acc[j] = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * n + j0;
      if constexpr (kGelu) {
        for (int64_t j = 0; j < w; ++j) {
          const T g = gy[at + j] * gelu_tanh_derivative_of(z[at + j]);
          gz[at + j] = g;
          acc[j] += static_cast<double>(g);
        }
      } else {
        for (int64_t j = 0; j < w; ++j) acc[j] += static_cast<double>(gy[at + j]);
      }
    }
    if (gb)
      for (int64_t j = 0; j < w; ++j) gb[j0 + j] = static_cast<T>(acc[j]);
  }
}

// bf16 linear: the product in f32 (oneDNN, f32 accumulation), then the f32 kernel's
// vectorised bias / GELU / bias-gradient passes on f32 copies, each bf16 output
// rounded once (cpu::round_into_bf16).
void linear_forward_bf16(Tensor& y, Tensor& z, const Tensor& x, const Tensor& w, const Tensor& b, Activation act) {
  const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
  Tensor acc = empty({rows, out}, DType::f32);
  linalg_bf16_gemm(false, true, rows, out, in, x.data<bf16>(), in, w.data<bf16>(), in, acc.data<float>(), DType::f32,
                   out);
  const Tensor bf = widen_bf16(b);
  const bool gelu = act == Activation::gelu_tanh;
  Tensor zf = gelu ? empty({rows, out}, DType::f32) : Tensor();
  float* pa = acc.data<float>();
  float* pz = gelu ? zf.data<float>() : nullptr;
  const float* pb = bf.data<float>();
  bf16* py = y.data<bf16>();
  bf16* pz16 = gelu ? z.data<bf16>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(out, 1));
  parallel_for(rows, grain, [&](int64_t lo, int64_t hi) {
    if (gelu)
      run_vector_isa([](auto... a) { bias_act_rows<float, true>(a...); }, pa, pz, pb, out, lo, hi);
    else
      run_vector_isa([](auto... a) { bias_act_rows<float, false>(a...); }, pa, pz, pb, out, lo, hi);
    for (int64_t i = lo * out; i < hi * out; ++i) {
      py[i] = bf16::from_float(pa[i]);
      if (gelu) pz16[i] = bf16::from_float(pz[i]);
    }
  });
}

// grad_z (f32, written when gelu) and grad_b (rounded into gb when defined) from grad_y
// (f32) and z (f32, when gelu) over [rows, n]: the f32 kernel's column pass.
void bias_grad_f32_for_bf16(Tensor* gz, Tensor& grad_b, const Tensor& gy, const Tensor* zf, int64_t rows, int64_t n) {
  Tensor gb = grad_b.defined() ? empty({n}, DType::f32) : Tensor();
  float* pgz = gz ? gz->data<float>() : nullptr;
  float* pgb = gb.defined() ? gb.data<float>() : nullptr;
  const float* pgy = gy.data<float>();
  const float* pz = zf ? zf->data<float>() : nullptr;
  parallel_for(n, 256, [&](int64_t lo, int64_t hi) {
    if (zf)
      run_vector_isa([](auto... a) { bias_grad_columns<float, true>(a...); }, pgz, pgb, pgy, pz, rows, n, lo, hi);
    else
      run_vector_isa([](auto... a) { bias_grad_columns<float, false>(a...); }, pgz, pgb, pgy, pz, rows, n, lo, hi);
  });
  if (gb.defined()) round_into_bf16(grad_b, gb);
}

void linear_backward_bf16(Tensor& grad_x, Tensor& grad_w, Tensor& grad_b, const Tensor& grad_y, const Tensor& x,
                          const Tensor& w, const Tensor& z, Activation act) {
  const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
  const bool gelu = act == Activation::gelu_tanh;
  Tensor gz_buf = gelu ? empty_like(grad_y) : Tensor{};
  if (gelu || grad_b.defined()) {
    const Tensor gy = widen_bf16(grad_y);
    if (gelu) {
      const Tensor zf = widen_bf16(z);
      Tensor gzf = empty({rows, out}, DType::f32);
      bias_grad_f32_for_bf16(&gzf, grad_b, gy, &zf, rows, out);
      round_into_bf16(gz_buf, gzf);
    } else {
      bias_grad_f32_for_bf16(nullptr, grad_b, gy, nullptr, rows, out);
    }
  }
  const bf16* gz = gelu ? gz_buf.data<bf16>() : grad_y.data<bf16>();
  if (grad_w.defined())
    linalg_bf16_gemm(true, false, out, in, rows, gz, out, x.data<bf16>(), in, grad_w.data<bf16>(), DType::bf16, in);
  if (grad_x.defined())
    linalg_bf16_gemm(false, false, rows, in, out, gz, out, w.data<bf16>(), in, grad_x.data<bf16>(), DType::bf16, in);
}

void gelu_input_backward_bf16(Tensor& grad_z, Tensor& grad_b, const Tensor& grad_y, const Tensor& w, const Tensor& z) {
  const int64_t in = w.size(1), out = w.size(0), rows = z.numel() / in;
  Tensor grad_m = empty({rows, in}, DType::f32);
  linalg_bf16_gemm(false, false, rows, in, out, grad_y.data<bf16>(), out, w.data<bf16>(), in, grad_m.data<float>(),
                   DType::f32, in);
  const Tensor zf = widen_bf16(z);
  Tensor gzf = empty({rows, in}, DType::f32);
  bias_grad_f32_for_bf16(&gzf, grad_b, grad_m, &zf, rows, in);
  round_into_bf16(grad_z, gzf);
}

}  // namespace

void linear_forward(Tensor& y, Tensor& z, const Tensor& x, const Tensor& w, const Tensor& b, Activation act) {
  if (x.dtype() == DType::bf16) return linear_forward_bf16(y, z, x, w, b, act);
  dispatch_float(x.dtype(), "linear", [&](auto tag) {
    using T = decltype(tag);
    const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
    T* py = y.data<T>();
    // x w^T over all rows: matmul_forward's call for a rank-2 b.
    gemm(false, true, rows, out, in, T(1), x.data<T>(), in, w.data<T>(), in, T(0), py, out);
    const T* pb = b.data<T>();
    const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(out, 1));
    if (act == Activation::gelu_tanh) {
      T* pz = z.data<T>();
      parallel_for(rows, grain, [&](int64_t lo, int64_t hi) {
        run_vector_isa([](auto... a) { bias_act_rows<T, true>(a...); }, py, pz, pb, out, lo, hi);
      });
    } else {
      parallel_for(rows, grain, [&](int64_t lo, int64_t hi) {
        run_vector_isa([](auto... a) { bias_act_rows<T, false>(a...); }, py, static_cast<T*>(nullptr), pb, out, lo,
                       hi);
      });
    }
  });
}

void linear_backward(Tensor& grad_x, Tensor& grad_w, Tensor& grad_b, const Tensor& grad_y, const Tensor& x,
                     const Tensor& w, const Tensor& z, Activation act) {
  if (x.dtype() == DType::bf16) return linear_backward_bf16(grad_x, grad_w, grad_b, grad_y, x, w, z, act);
  dispatch_float(x.dtype(), "linear_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
    const T* gy = grad_y.data<T>();
    // grad_z: grad_y itself, or a new buffer for grad_y gelu'(z), made in the pass
    // that sums grad_b.
    const bool gelu = act == Activation::gelu_tanh;
    Tensor gz_buf = gelu ? empty_like(grad_y) : Tensor{};
    const T* gz = gelu ? gz_buf.data<T>() : gy;
    if (gelu || grad_b.defined()) {
      T* gb = grad_b.defined() ? grad_b.data<T>() : nullptr;
      T* gzw = gelu ? gz_buf.data<T>() : nullptr;
      const T* pz = gelu ? z.data<T>() : nullptr;
      parallel_for(out, 256, [&](int64_t lo, int64_t hi) {
        if (gelu)
          run_vector_isa([](auto... a) { bias_grad_columns<T, true>(a...); }, gzw, gb, gy, pz, rows, out, lo, hi);
        else
          run_vector_isa([](auto... a) { bias_grad_columns<T, false>(a...); }, gzw, gb, gy, pz, rows, out, lo, hi);
      });
    }
    // matmul's backward for x [R, in] times w^T (linalg.cpp): the same GEMMs.
    if (grad_w.defined())
      gemm(true, false, out, in, rows, T(1), gz, out, x.data<T>(), in, T(0), grad_w.data<T>(), in);
    if (grad_x.defined())
      gemm(false, false, rows, in, out, T(1), gz, out, w.data<T>(), in, T(0), grad_x.data<T>(), in);
  });
}

void gelu_input_backward(Tensor& grad_z, Tensor& grad_b, const Tensor& grad_y, const Tensor& w, const Tensor& z) {
  if (z.dtype() == DType::bf16) return gelu_input_backward_bf16(grad_z, grad_b, grad_y, w, z);
  dispatch_float(z.dtype(), "gelu_input_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t in = w.size(1), out = w.size(0), rows = z.numel() / in;
    // grad of gelu(z): linear_backward's grad_x GEMM; then its GELU pass (the same bits).
    Tensor grad_m = empty_like(z);
    gemm(false, false, rows, in, out, T(1), grad_y.data<T>(), out, w.data<T>(), in, T(0), grad_m.data<T>(), in);
    T* gz = grad_z.data<T>();
    T* gb = grad_b.defined() ? grad_b.data<T>() : nullptr;
    const T* gm = grad_m.data<T>();
    const T* pz = z.data<T>();
    parallel_for(in, 256, [&](int64_t lo, int64_t hi) {
      run_vector_isa([](auto... a) { bias_grad_columns<T, true>(a...); }, gz, gb, gm, pz, rows, in, lo, hi);
    });
  });
}

}  // namespace moetrain::cpu
