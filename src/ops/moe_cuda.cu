// CUDA twin of the grouped expert GEMMs (moe_cpu.cpp): one cuBLAS GEMM per
// expert with rows, on the device's stream (counts are on the host). With many
// small experts the launches dominate; cuBLAS's grouped-batched GEMM (one call
// for all experts) is the next step.
#include "ops/moe_kernels.h"

#include "backend/cuda/cublas.h"
#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1), es = dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw_data());
  const char* pw = static_cast<const char*>(w.raw_data());
  char* py = static_cast<char*>(y.raw_data());
  int dev = x.device().index;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t m = counts[e];
    if (m > 0)  // y_e [m, out] = x_e [m, in] w_e^T
      gemm(x.dtype(), false, true, m, out, in, 1.0, px + row * in * es, in, 0,
           pw + static_cast<int64_t>(e) * out * in * es, in, 0, 0.0, py + row * out * es, out, 0, 1, dev);
    row += m;
  }
}

void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                             const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1), es = dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw_data());
  const char* pw = static_cast<const char*>(w.raw_data());
  const char* pdy = static_cast<const char*>(dy.raw_data());
  char* pdx = static_cast<char*>(dx.raw_data());
  char* pdw = static_cast<char*>(dw.raw_data());
  int dev = x.device().index;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t m = counts[e];
    char* dw_e = pdw + static_cast<int64_t>(e) * out * in * es;
    if (m == 0) {
      memset_zero(dw_e, out * in * es, dev);
      continue;
    }
    // dx_e [m, in] = dy_e [m, out] w_e [out, in];  dw_e [out, in] = dy_e^T x_e
    gemm(x.dtype(), false, false, m, in, out, 1.0, pdy + row * out * es, out, 0,
         pw + static_cast<int64_t>(e) * out * in * es, in, 0, 0.0, pdx + row * in * es, in, 0, 1, dev);
    gemm(x.dtype(), true, false, out, in, m, 1.0, pdy + row * out * es, out, 0, px + row * in * es, in, 0, 0.0, dw_e,
         in, 0, 1, dev);
    row += m;
  }
}

}  // namespace moetrain::cuda
