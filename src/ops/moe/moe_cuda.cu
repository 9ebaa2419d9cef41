// CUDA twin of the grouped expert GEMMs (moe_cpu.cpp): every expert with rows in
// one cuBLAS grouped-batched GEMM per product (cuda::gemm_grouped; f64 takes a
// GEMM per expert), on the device's stream; the counts are on the host.
#include "ops/moe/moe_kernels.h"

#include <vector>

#include "backend/cuda/cublas.h"
#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1), es = dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw_data());
  const char* pw = static_cast<const char*>(w.raw_data());
  char* py = static_cast<char*>(y.raw_data());
  std::vector<GemmItem> items;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t m = counts[e];
    // y_e [m, out] = x_e [m, in] w_e^T
    items.push_back({m, out, in, px + row * in * es, in, pw + static_cast<int64_t>(e) * out * in * es, in,
                     py + row * out * es, out});
    row += m;
  }
  gemm_grouped(x.dtype(), false, true, items, x.device().index);
}

void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                             const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1), es = dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw_data());
  const char* pw = static_cast<const char*>(w.raw_data());
  const char* pdy = static_cast<const char*>(dy.raw_data());
  char* pdx = static_cast<char*>(dx.raw_data());
  char* pdw = static_cast<char*>(dw.raw_data());
  const int dev = x.device().index;
  std::vector<GemmItem> data, weight;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t m = counts[e];
    char* dw_e = pdw + static_cast<int64_t>(e) * out * in * es;
    if (m == 0) {
      memset_zero(dw_e, out * in * es, dev);
      continue;
    }
    // dx_e [m, in] = dy_e [m, out] w_e [out, in];  dw_e [out, in] = dy_e^T x_e
    data.push_back({m, in, out, pdy + row * out * es, out, pw + static_cast<int64_t>(e) * out * in * es, in,
                    pdx + row * in * es, in});
    weight.push_back({out, in, m, pdy + row * out * es, out, px + row * in * es, in, dw_e, in});
    row += m;
  }
  gemm_grouped(x.dtype(), false, false, data, dev);
  gemm_grouped(x.dtype(), true, false, weight, dev);
}

}  // namespace moetrain::cuda
