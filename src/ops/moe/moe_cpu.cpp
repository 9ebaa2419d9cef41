// Grouped GEMMs: experts run one after the other, each one BLAS call over all of
// its rows (BLAS threads inside). Rows of expert e start at the prefix sum of counts.
#include <algorithm>

#include "backend/cpu/blas.h"
#include "core/dispatch.h"
#include "ops/moe/moe_kernels.h"

namespace moetrain::cpu {

void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1);
  dispatch_float(x.dtype(), "grouped_linear", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    T* py = y.data<T>();
    int64_t row = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t m = counts[e];
      if (m > 0)  // y_e [m, out] = x_e [m, in] w_e^T
        gemm(false, true, m, out, in, T(1), px + row * in, in, pw + static_cast<int64_t>(e) * out * in, in, T(0),
             py + row * out, out);
      row += m;
    }
  });
}

void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                             const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1);
  dispatch_float(x.dtype(), "grouped_linear", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    T* pdw = dw.data<T>();
    int64_t row = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t m = counts[e];
      T* dw_e = pdw + static_cast<int64_t>(e) * out * in;
      if (m == 0) {
        std::fill(dw_e, dw_e + out * in, T(0));
        continue;
      }
      // dx_e [m, in] = dy_e [m, out] w_e [out, in];  dw_e [out, in] = dy_e^T x_e
      gemm(false, false, m, in, out, T(1), pdy + row * out, out, pw + static_cast<int64_t>(e) * out * in, in, T(0),
           pdx + row * in, in);
      gemm(true, false, out, in, m, T(1), pdy + row * out, out, px + row * in, in, T(0), dw_e, in);
      row += m;
    }
  });
}

}  // namespace moetrain::cpu
