// CUDA twin of matmul_forward (linalg_cpu.cpp): one strided-batched cuBLAS GEMM.
#include "ops/linalg/linalg_kernels.h"

#include "backend/cuda/cublas.h"
#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  int64_t m = out.size(-2), n = out.size(-1);
  int64_t k = trans_a ? a.size(-2) : a.size(-1);
  int64_t lda = a.size(-1), ldb = b.size(-1);
  int dev = out.device().index;
  if (b.dim() == 2 && (a.dim() == 2 || !trans_a)) {
    // All rows of a at once: [rows, K] x op(b).
    int64_t rows = a.dim() == 2 ? m : a.shape().numel(0, a.dim() - 1);
    gemm(a.dtype(), trans_a, trans_b, rows, n, k, 1.0, a.raw_data(), lda, 0, b.raw_data(), ldb, 0, 0.0,
         out.raw_data(), n, 0, 1, dev);
    return;
  }
  int64_t batch = out.shape().numel(0, out.dim() - 2);
  int64_t a_step = a.dim() == 2 ? 0 : a.size(-2) * a.size(-1);
  int64_t b_step = b.dim() == 2 ? 0 : b.size(-2) * b.size(-1);
  gemm(a.dtype(), trans_a, trans_b, m, n, k, 1.0, a.raw_data(), lda, a_step, b.raw_data(), ldb, b_step, 0.0,
       out.raw_data(), n, m * n, batch, dev);
}

}  // namespace moetrain::cuda
