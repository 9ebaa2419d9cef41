// Row-major GEMM through CBLAS (OpenBLAS, OpenMP flavour):
//   C[M,N] = alpha * op(A) op(B) + beta * C,  op(X) = X or X^T.
// Called from inside our own OpenMP regions it runs on the calling thread only.
#pragma once

#include <cstdint>

namespace moetrain::cpu {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

const char* blas_name();  // e.g. "OpenBLAS 0.3.21 (openmp) Haswell"

}  // namespace moetrain::cpu
