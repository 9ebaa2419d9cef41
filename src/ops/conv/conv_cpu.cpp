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

// A bf16 tensor's values in f32 (the weight [C, W] and dy: small or read many times),
// else the tensor's own f32 data.
const float* conv_f32(const Tensor& t, std::vector<float>& buf) {
  if (t.dtype() == DType::f32) return t.data<float>();
  buf.resize(static_cast<size_t>(t.numel()));
  widen_bf16_row(buf.data(), t.data<bf16>(), t.numel());
  return buf.data();
}

// A row of f32 results into out (f32, or bf16 rounded once).
void conv_store_row(const Tensor& out, int64_t row, const float* v, int64_t C) {
  if (out.dtype() == DType::bf16) round_bf16_row(out.data<bf16>() + row * C, v, C);
  else std::copy(v, v + C, out.data<float>() + row * C);
}

// bf16 anywhere (x, the weight, so y and the gradients): the f32 kernels' arithmetic
// on x read as stored and the rest widened, each bf16 output row rounded once, the
// bits of cpu::run_kernel's whole-tensor widening without its f32 copy of x and of
// grad_x (ops/common/bf16_rows.h). X: x's storage.
template <class X>
void conv_forward_bf16(Tensor& y, const Tensor& x, const Tensor& w, bool silu) {
  const int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
  std::vector<float> wbuf;
  const float* pw = conv_f32(w, wbuf);
  const X* px = x.data<X>();
  parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(static_cast<size_t>(C));
    for (int64_t bt = lo; bt < hi; ++bt) {
      float* yr = row.data();
      conv_row(yr, px, pw, bt / Tn, bt % Tn, Tn, C, W);
      if (silu)
        for (int64_t c = 0; c < C; ++c) yr[c] = yr[c] * sigmoid_of(yr[c]);
      conv_store_row(y, bt, yr, C);
    }
  });
}

template <class X>
void conv_backward_bf16(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x, const Tensor& w,
                        bool silu) {
  const int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
  std::vector<float> wbuf, gbuf;
  const float* pw = conv_f32(w, wbuf);
  const X* px = x.data<X>();
  const float* dy = conv_f32(grad_y, gbuf);
  std::vector<float> g;
  if (silu) {
    g.resize(static_cast<size_t>(B * Tn * C));
    parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t bt = lo; bt < hi; ++bt) {
        float* gr = g.data() + bt * C;
        conv_row(gr, px, pw, bt / Tn, bt % Tn, Tn, C, W);
        for (int64_t c = 0; c < C; ++c) {
          const float a = gr[c], sg = sigmoid_of(a);
          gr[c] = dy[bt * C + c] * (sg * (1.0f + a * (1.0f - sg)));
        }
      }
    });
    dy = g.data();
  }
  if (grad_x)
    parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(static_cast<size_t>(C));
      for (int64_t bs = lo; bs < hi; ++bs) {
        const int64_t b = bs / Tn, s = bs % Tn;
        float* xr = row.data();
        for (int64_t c = 0; c < C; ++c) xr[c] = 0.0f;
        for (int64_t i = 0; i < W; ++i) {
          const int64_t t = s + W - 1 - i;
          if (t >= Tn) continue;
          const float* gr = dy + (b * Tn + t) * C;
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
          const float* gr = dy + (b * Tn + t) * C;
          for (int64_t i = 0; i < W; ++i) {
            const int64_t s = t - W + 1 + i;
            if (s < 0) continue;
            const X* xr = px + (b * Tn + s) * C;
            for (int64_t c = c0; c < c1; ++c)
              acc[static_cast<size_t>((c - c0) * W + i)] +=
                  static_cast<double>(gr[c]) * static_cast<double>(conv_in<float>(xr[c]));
          }
        }
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t i = 0; i < W; ++i) {
          const float v = static_cast<float>(acc[static_cast<size_t>((c - c0) * W + i)]);  // the f32 kernel's store
          if (grad_w->dtype() == DType::bf16) grad_w->data<bf16>()[c * W + i] = bf16::from_float(v);
          else grad_w->data<float>()[c * W + i] = v;
        }
    });
}

}  // namespace

void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w, bool silu) {
  if (x.dtype() == DType::bf16 || w.dtype() == DType::bf16)
    return x.dtype() == DType::bf16 ? conv_forward_bf16<bf16>(y, x, w, silu) : conv_forward_bf16<float>(y, x, w, silu);
  dispatch_float(x.dtype(), "causal_conv1d", [&](auto tag) {
    using T = decltype(tag);
    int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    T* py = y.data<T>();
    parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t bt = lo; bt < hi; ++bt) {
        T* yr = py + bt * C;
        conv_row(yr, px, pw, bt / Tn, bt % Tn, Tn, C, W);
        if (silu)  // the CPU silu's formula (elementwise_cpu.cpp)
          for (int64_t c = 0; c < C; ++c) yr[c] = yr[c] * sigmoid_of(yr[c]);
      }
    });
  });
}

void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                            const Tensor& w, bool silu) {
  if (x.dtype() == DType::bf16 || w.dtype() == DType::bf16)
    return x.dtype() == DType::bf16 ? conv_backward_bf16<bf16>(grad_x, grad_w, grad_y, x, w, silu)
                                    : conv_backward_bf16<float>(grad_x, grad_w, grad_y, x, w, silu);
  dispatch_float(x.dtype(), "causal_conv1d_backward", [&](auto tag) {
    using T = decltype(tag);
    int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* dy = grad_y.data<T>();
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
    if (grad_x) {
      T* dx = grad_x->data<T>();
      parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t bs = lo; bs < hi; ++bs) {
          int64_t b = bs / Tn, s = bs % Tn;
          T* xr = dx + bs * C;
          for (int64_t c = 0; c < C; ++c) xr[c] = T(0);
          for (int64_t i = 0; i < W; ++i) {
            int64_t t = s + W - 1 - i;
            if (t >= Tn) continue;
            const T* gr = dy + (b * Tn + t) * C;
            for (int64_t c = 0; c < C; ++c) xr[c] += pw[c * W + i] * gr[c];
          }
        }
      });
    }
    if (grad_w) {
      T* dw = grad_w->data<T>();
      parallel_for(C, 16, [&](int64_t c0, int64_t c1) {
        std::vector<double> acc(static_cast<size_t>((c1 - c0) * W), 0.0);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < Tn; ++t) {
            const T* gr = dy + (b * Tn + t) * C;
            for (int64_t i = 0; i < W; ++i) {
              int64_t s = t - W + 1 + i;
              if (s < 0) continue;
              const T* xr = px + (b * Tn + s) * C;
              for (int64_t c = c0; c < c1; ++c)
                acc[static_cast<size_t>((c - c0) * W + i)] += static_cast<double>(gr[c]) * xr[c];
            }
          }
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t i = 0; i < W; ++i) dw[c * W + i] = static_cast<T>(acc[static_cast<size_t>((c - c0) * W + i)]);
      });
    }
  });
}

}  // namespace moetrain::cpu
