// CPU kernels of renormalize_rows (route_weights.h): a row per iteration, the row's
// arithmetic in route_weights_simt.h (the GPU's too). f32 and f64 (bf16 is widened
// by MT_ON_DEVICE).
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/router/route_weights_kernels.h"
#include "ops/router/route_weights_simt.h"

namespace moetrain::cpu {

void renormalize_rows_forward(Tensor& y, const Tensor& w, double eps) {
  dispatch_float(w.dtype(), "renormalize_rows", [&](auto tag) {
    using T = decltype(tag);
    const int64_t k = w.size(-1), rows = w.numel() / k;
    const T* pw = w.data<T>();
    T* py = y.data<T>();
    parallel_for(rows, 1024, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* wr = pw + r * k;
        const T den = simt::renormalize_denominator([wr](int64_t j) { return wr[j]; }, k, static_cast<T>(eps));
        for (int64_t j = 0; j < k; ++j) py[r * k + j] = wr[j] / den;
      }
    });
  });
}

void renormalize_rows_backward(Tensor& grad_w, const Tensor& grad_y, const Tensor& w, double eps) {
  dispatch_float(w.dtype(), "renormalize_rows_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t k = w.size(-1), rows = w.numel() / k;
    const T* pw = w.data<T>();
    const T* pg = grad_y.data<T>();
    T* pgw = grad_w.data<T>();
    parallel_for(rows, 1024, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* wr = pw + r * k;
        const T* gr = pg + r * k;
        auto load_w = [wr](int64_t j) { return wr[j]; };
        const T den = simt::renormalize_denominator(load_w, k, static_cast<T>(eps));
        const T dot = simt::renormalize_dot(load_w, [gr](int64_t j) { return gr[j]; }, k, den);
        for (int64_t j = 0; j < k; ++j) pgw[r * k + j] = (gr[j] - dot) / den;
      }
    });
  });
}

}  // namespace moetrain::cpu
