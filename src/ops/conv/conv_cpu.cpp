// Depthwise causal conv kernels. Forward and dx: parallel over (batch, time
// rows), channels innermost (contiguous). dw: each thread owns a channel range
// and sums over (b, t) in order, independent of the thread count.
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/conv/conv_kernels.h"

namespace moetrain::cpu {

void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w) {
  dispatch_float(x.dtype(), "causal_conv1d", [&](auto tag) {
    using T = decltype(tag);
    int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    T* py = y.data<T>();
    parallel_for(B * Tn, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t bt = lo; bt < hi; ++bt) {
        int64_t b = bt / Tn, t = bt % Tn;
        T* yr = py + bt * C;
        for (int64_t c = 0; c < C; ++c) yr[c] = T(0);
        for (int64_t i = 0; i < W; ++i) {
          int64_t s = t - (W - 1) + i;
          if (s < 0) continue;
          const T* xr = px + (b * Tn + s) * C;
          for (int64_t c = 0; c < C; ++c) yr[c] += pw[c * W + i] * xr[c];
        }
      }
    });
  });
}

void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                            const Tensor& w) {
  dispatch_float(x.dtype(), "causal_conv1d_backward", [&](auto tag) {
    using T = decltype(tag);
    int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* dy = grad_y.data<T>();
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
