// GEMMs on a device through cuBLAS, in row-major terms (our layout):
//   C[i] = alpha * op(A[i]) op(B[i]) + beta * C[i]  for i < batch,
// op(X) = X^T when trans_x; A[i] = a + i * stride_a (0: shared), same for B, C.
// f32 computes in f32 (TF32 tensor cores only after set_allow_tf32(true)), f64 in
// f64, bf16 inputs/outputs with f32 accumulation. Runs on the device's stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace moetrain::cuda {

void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void* a,
          int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, double beta, void* c,
          int64_t ldc, int64_t stride_c, int64_t batch, int device);

// One row-major GEMM of a group: C = op(A) op(B), A m x k (after op), C m x n.
struct GemmItem {
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* c;
  int64_t ldc;
};

// C_i = op(A_i) op(B_i) for every item (alpha 1, beta 0; the transposes are shared),
// f32 and bf16 in one cuBLAS grouped-batched call (cublasGemmGroupedBatchedEx: one
// launch for all experts, whatever their row counts), f64 one GEMM per item. Items
// with m or n = 0 are skipped; k = 0 writes zeros. Where cuBLAS does not support the
// grouped call for a type (CUBLAS_STATUS_NOT_SUPPORTED), one GEMM per item.
void gemm_grouped(DType dtype, bool trans_a, bool trans_b, const std::vector<GemmItem>& items, int device);

// Whether f32 GEMMs may use TF32 tensor cores (10-bit mantissa products); off by default.
void set_allow_tf32(bool on);
bool allow_tf32();

}  // namespace moetrain::cuda
