// Depthwise causal conv kernels. Forward and dx: parallel over (batch, time
// rows), channels innermost (contiguous). dw: each thread owns a channel range
// and sums over (b, t) in order, independent of the thread count. bf16 tensors
// (train.dtype bf16: KDA's bf16 projections under an f32 conv weight) are read as
// stored and each bf16 output row rounded once: the f32 arithmetic, the widened bits.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_rows.h"
#include "ops/common/math.h"
#include "ops/conv/conv_kernels.h"

namespace moetrain::cpu {

namespace {

// x's elements in the compute type T: bf16 widened (exactly), else as they are.
template <class T, class X>
inline T conv_in(X v) {
  if constexpr (std::is_same_v<X, bf16>) return v.to_float();
  else return v;
}

// y[b, t, :] = conv(x) at row bt (the forward's sums, in its order); x stored as X.
template <class T, class X>
void conv_row(T* yr, const X* px, const T* pw, int64_t b, int64_t t, int64_t Tn, int64_t C, int64_t W) {
  for (int64_t c = 0; c < C; ++c) yr[c] = T(0);
  for (int64_t i = 0; i < W; ++i) {
    int64_t s = t - (W - 1) + i;
    if (s < 0) continue;
    const X* xr = px + (b * Tn + s) * C;
    for (int64_t c = 0; c < C; ++c) yr[c] += pw[c * W + i] * conv_in<T>(xr[c]);
  }
}

// t's values in the compute type T: its own data when it is stored as T, else (bf16
// under T = f32) widened once into buf (the weight [C, W] and dy: small or read
// many times).
template <class T>
const T* conv_values(const Tensor& t, std::vector<T>& buf) {
  if (t.dtype() == dtype_v<T>) return t.data<T>();
  if constexpr (std::is_same_v<T, float>) {
    buf.resize(static_cast<size_t>(t.numel()));
    widen_bf16_row(buf.data(), t.data<bf16>(), t.numel());
    return buf.data();
  } else {
    MT_THROW("causal_conv1d: {} tensor with {} compute", t.dtype(), dtype_v<T>);
  }
}

// Where row `row` of out is computed: in place when out is stored as T, else in buf
// (rounded into out by conv_store_row).
template <class T>
T* conv_out_row(const Tensor& out, int64_t row, int64_t C, std::vector<T>& buf) {
  if (out.dtype() == dtype_v<T>) return out.data<T>() + row * C;
  buf.resize(static_cast<size_t>(C));
  return buf.data();
}
template <class T>
void conv_store_row(const Tensor& out, int64_t row, const T* v, int64_t C) {
  if (out.dtype() == dtype_v<T>) return;  // computed in place
  if constexpr (std::is_same_v<T, float>) round_bf16_row(out.data<bf16>() + row * C, v, C);
}

// The kernels in the compute type T (f32 or f64) on x stored as X (T, or bf16 under
// T = f32). bf16 anywhere (x, the weight, so y and the gradients): the f32
// arithmetic on x read as stored and the rest widened, each bf16 output row rounded
// once: the bits of cpu::run_kernel's whole-tensor widening without its f32 copies of
// x and grad_x (ops/common/bf16_rows.h).
template <class T, class X>
void conv_forward(Tensor& y, const Tensor& x, const Tensor& w, bool silu) {
  const int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
  std::vector<T> wbuf;
  const T* pw = conv_values(w, wbuf);
  const X* px = x.data<X>();
  parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
    std::vector<T> row;
    for (int64_t bt = lo; bt < hi; ++bt) {
      T* yr = conv_out_row(y, bt, C, row);
      conv_row(yr, px, pw, bt / Tn, bt % Tn, Tn, C, W);
      if (silu)  // the CPU silu's formula (elementwise_cpu.cpp)
        for (int64_t c = 0; c < C; ++c) yr[c] = yr[c] * sigmoid_of(yr[c]);
      conv_store_row(y, bt, yr, C);
    }
  });
}

template <class T, class X>
void conv_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x, const Tensor& w,
                   bool silu) {
  const int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
  std::vector<T> wbuf, gbuf;
  const T* pw = conv_values(w, wbuf);
  const X* px = x.data<X>();
  const T* dy = conv_values(grad_y, gbuf);
  // With silu the conv's gradient is g = dy silu'(a), a = conv(x) recomputed (the
  // CPU silu's derivative, elementwise_cpu.cpp), then the plain conv backward of g.
  std::vector<T> g;
  if (silu) {
    g.resize(static_cast<size_t>(B * Tn * C));
    parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t bt = lo; bt < hi; ++bt) {
        T* gr = g.data() + bt * C;
        conv_row(gr, px, pw, bt / Tn, bt % Tn, Tn, C, W);
        for (int64_t c = 0; c < C; ++c) {
          const T a = gr[c], sg = sigmoid_of(a);
          gr[c] = dy[bt * C + c] * (sg * (T(1) + a * (T(1) - sg)));
        }
      }
    });
    dy = g.data();
  }
  if (grad_x)
    parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
      std::vector<T> row;
      for (int64_t bs = lo; bs < hi; ++bs) {
        const int64_t b = bs / Tn, s = bs % Tn;
        T* xr = conv_out_row(*grad_x, bs, C, row);
        for (int64_t c = 0; c < C; ++c) xr[c] = T(0);
        for (int64_t i = 0; i < W; ++i) {
          const int64_t t = s + W - 1 - i;
          if (t >= Tn) continue;
          const T* gr = dy + (b * Tn + t) * C;
          for (int64_t c = 0; c < C; ++c) xr[c] += pw[c * W + i] * gr[c];
        }
        conv_store_row(*grad_x, bs, xr, C);
      }
    });
  if (grad_w)
    parallel_for(C, 16, [&](int64_t c0, int64_t c1) {
      std::vector<double> acc(static_cast<size_t>((c1 - c0) * W), 0.0);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < Tn; ++t) {
          const T* gr = dy + (b * Tn + t) * C;
          for (int64_t i = 0; i < W; ++i) {
            const int64_t s = t - W + 1 + i;
            if (s < 0) continue;
            const X* xr = px + (b * Tn + s) * C;
            for (int64_t c = c0; c < c1; ++c)
              acc[static_cast<size_t>((c - c0) * W + i)] += static_cast<double>(gr[c]) * conv_in<T>(xr[c]);
          }
        }
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t i = 0; i < W; ++i) {
          const T v = static_cast<T>(acc[static_cast<size_t>((c - c0) * W + i)]);  // the f32 (f64) kernel's store
          if (grad_w->dtype() == dtype_v<T>) grad_w->data<T>()[c * W + i] = v;
          else if constexpr (std::is_same_v<T, float>) grad_w->data<bf16>()[c * W + i] = bf16::from_float(v);
        }
    });
}

}  // namespace

void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w, bool silu) {
  if (x.dtype() == DType::bf16) return conv_forward<float, bf16>(y, x, w, silu);
  if (w.dtype() == DType::bf16) return conv_forward<float, float>(y, x, w, silu);
  dispatch_float(x.dtype(), "causal_conv1d", [&](auto tag) {
    using T = decltype(tag);
    conv_forward<T, T>(y, x, w, silu);
  });
}

void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                            const Tensor& w, bool silu) {
  if (x.dtype() == DType::bf16) return conv_backward<float, bf16>(grad_x, grad_w, grad_y, x, w, silu);
  if (w.dtype() == DType::bf16) return conv_backward<float, float>(grad_x, grad_w, grad_y, x, w, silu);
  dispatch_float(x.dtype(), "causal_conv1d_backward", [&](auto tag) {
    using T = decltype(tag);
    conv_backward<T, T>(grad_x, grad_w, grad_y, x, w, silu);
  });
}

}  // namespace moetrain::cpu
