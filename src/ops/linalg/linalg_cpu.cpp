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
#include "ops/common/bf16_rows.h"
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
// rows in order: sum_to's order (elementwise_cpu.cpp), so the same bits. T is the
// arithmetic type, S the type of gz, gb and z and G grad_y's (T, or bf16: each value
// read widened, gz and gb rounded once from the f32 values, the bits of widening the
// tensors first).
template <class T, bool kGelu, class S = T, class G = S>
inline void bias_grad_columns(S* gz, S* __restrict gb, const G* gy, const S* __restrict z, int64_t rows, int64_t n,
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
          const T g = static_cast<T>(widened_value(gy[at + j])) *
                      gelu_tanh_derivative_of(static_cast<T>(widened_value(z[at + j])));
          if constexpr (std::is_same_v<S, T>)
            gz[at + j] = g;
          else
            gz[at + j] = S::from_float(g);
          acc[j] += static_cast<double>(g);
        }
      } else {
        for (int64_t j = 0; j < w; ++j) acc[j] += static_cast<double>(widened_value(gy[at + j]));
      }
    }
    if (gb)
      for (int64_t j = 0; j < w; ++j) {
        if constexpr (std::is_same_v<S, T>)
          gb[j0 + j] = static_cast<T>(acc[j]);
        else
          store_rounded(gb[j0 + j], acc[j]);
      }
  }
}

// Rows [lo, hi) of a bf16 linear's f32 product acc [rows, n]: the bias (and GELU) pass
// of bias_act_rows<float> on each row, z's f32 row in the per-thread zrow, then y (and
// z) rounded once into bf16.
template <bool kGelu>
inline void bias_act_rows_bf16(float* __restrict acc, bf16* __restrict y, bf16* __restrict z, float* __restrict zrow,
                               const float* __restrict b, int64_t n, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    float* ar = acc + r * n;
    bias_act_rows<float, kGelu>(ar, zrow, b, n, 0, 1);
    round_bf16_row(y + r * n, ar, n);
    if constexpr (kGelu) round_bf16_row(z + r * n, zrow, n);
  }
}

// bf16 linear: the product in f32 (oneDNN, f32 accumulation), then the f32 kernel's
// bias / GELU / bias-gradient arithmetic reading the bf16 tensors as they are, each
// bf16 output rounded once: the bits of running the f32 passes on widened copies,
// without those copies (the f32 product itself is the one f32 tensor left: the
// ledger's bf16-on-the-CPU term, nn/ledger.h).
void linear_forward_bf16(Tensor& y, Tensor& z, const Tensor& x, const Tensor& w, const Tensor& b, Activation act) {
  const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
  Tensor acc = empty({rows, out}, DType::f32);
  linalg_bf16_gemm(false, true, rows, out, in, x.data<bf16>(), in, w.data<bf16>(), in, acc.data<float>(), DType::f32,
                   out);
  std::vector<float> bbuf;
  const float* pb = f32_operand(b, bbuf);
  const bool gelu = act == Activation::gelu_tanh;
  float* pa = acc.data<float>();
  bf16* py = y.data<bf16>();
  bf16* pz = gelu ? z.data<bf16>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(out, 1));
  parallel_for(rows, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> zrow(gelu ? static_cast<size_t>(out) : 0);
    if (gelu)
      run_vector_isa([](auto... a) { bias_act_rows_bf16<true>(a...); }, pa, py, pz, zrow.data(), pb, out, lo, hi);
    else
      run_vector_isa([](auto... a) { bias_act_rows_bf16<false>(a...); }, pa, py, pz, zrow.data(), pb, out, lo, hi);
  });
}

// grad_z (bf16, written when gelu) and grad_b (bf16, when defined) from grad_y (bf16,
// or f32: GELU's input gradient product) and z (bf16, when gelu) over [rows, n]: the
// f32 kernel's column pass on the values as stored.
template <class G>
void bias_grad_bf16(bf16* gz, Tensor& grad_b, const G* gy, const bf16* z, int64_t rows, int64_t n) {
  bf16* gb = grad_b.defined() ? grad_b.data<bf16>() : nullptr;
  parallel_for(n, 256, [&](int64_t lo, int64_t hi) {
    if (z)
      run_vector_isa([](auto... a) { bias_grad_columns<float, true, bf16, G>(a...); }, gz, gb, gy, z, rows, n, lo, hi);
    else
      run_vector_isa([](auto... a) { bias_grad_columns<float, false, bf16, G>(a...); }, gz, gb, gy, z, rows, n, lo,
                     hi);
  });
}

void linear_backward_bf16(Tensor& grad_x, Tensor& grad_w, Tensor& grad_b, const Tensor& grad_y, const Tensor& x,
                          const Tensor& w, const Tensor& z, Activation act) {
  const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
  const bool gelu = act == Activation::gelu_tanh;
  Tensor gz_buf = gelu ? empty_like(grad_y) : Tensor{};
  if (gelu || grad_b.defined())
    bias_grad_bf16<bf16>(gelu ? gz_buf.data<bf16>() : nullptr, grad_b, grad_y.data<bf16>(),
                         gelu ? z.data<bf16>() : nullptr, rows, out);
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
  bias_grad_bf16<float>(grad_z.data<bf16>(), grad_b, grad_m.data<float>(), z.data<bf16>(), rows, in);
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
