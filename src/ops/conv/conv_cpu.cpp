// Depthwise causal conv kernels. Forward and dx: parallel over (batch, time
// rows), channels innermost (contiguous). dw: each thread owns a channel range
// and sums over (b, t) in order, independent of the thread count.
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/conv/conv_kernels.h"
#include "ops/common/math.h"

namespace moetrain::cpu {

namespace {

// y[b, t, :] = conv(x) at row bt (the forward's sums, in its order).
template <class T>
void conv_row(T* yr, const T* px, const T* pw, int64_t b, int64_t t, int64_t Tn, int64_t C, int64_t W) {
  for (int64_t c = 0; c < C; ++c) yr[c] = T(0);
  for (int64_t i = 0; i < W; ++i) {
    int64_t s = t - (W - 1) + i;
    if (s < 0) continue;
    const T* xr = px + (b * Tn + s) * C;
    for (int64_t c = 0; c < C; ++c) yr[c] += pw[c * W + i] * xr[c];
  }
}

}  // namespace

void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w, bool silu) {
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
