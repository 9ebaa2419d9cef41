// cuBLAS calls (compiled only with the CUDA backend): one handle per device,
// bound to the device's stream. Row-major C = op(A) op(B) is column-major
// C^T = op(B)^T op(A)^T, so the operands swap and the transposes stay.
#include "backend/cuda/cublas.h"

#include <array>
#include <atomic>
#include <mutex>

#include <cublas_v2.h>

#include "backend/cuda/check.h"
#include "backend/cuda/runtime.h"

#define MT_CUBLAS_CHECK(call)                                                                       \
  do {                                                                                              \
    cublasStatus_t st_ = (call);                                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                                  \
      throw ::moetrain::Error(::fmt::format("cuBLAS call {} failed: {} ({})", #call,                 \
                                            cublasGetStatusString(st_), static_cast<int>(st_)));   \
  } while (0)

namespace moetrain::cuda {

namespace {

std::atomic<bool> g_allow_tf32{false};

std::array<std::once_flag, kMaxDevices> g_handle_once;
std::array<cublasHandle_t, kMaxDevices> g_handle{};

cublasHandle_t handle(int device) {
  MT_CHECK(device >= 0 && device < kMaxDevices, "cuda:{}: no such device", device);
  set_device(device);
  std::call_once(g_handle_once[static_cast<size_t>(device)], [device] {
    cublasHandle_t h = nullptr;
    MT_CUBLAS_CHECK(cublasCreate(&h));
    MT_CUBLAS_CHECK(cublasSetStream(h, stream(device)));
    g_handle[static_cast<size_t>(device)] = h;  // kept for the process's life
  });
  return g_handle[static_cast<size_t>(device)];
}

int to_int(int64_t v, const char* what) {
  MT_CHECK(v >= 0 && v <= INT32_MAX, "cuBLAS GEMM: {} = {} exceeds the 32-bit range cuBLAS takes", what, v);
  return static_cast<int>(v);
}

}  // namespace

void set_allow_tf32(bool on) { g_allow_tf32 = on; }
bool allow_tf32() { return g_allow_tf32; }

void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void* a,
          int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, double beta, void* c,
          int64_t ldc, int64_t stride_c, int64_t batch, int device) {
  if (m == 0 || n == 0 || batch == 0) return;
  cudaDataType_t type;
  cublasComputeType_t compute;
  switch (dtype) {
    case DType::f32:
      type = CUDA_R_32F;
      compute = allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      break;
    case DType::f64: type = CUDA_R_64F; compute = CUBLAS_COMPUTE_64F; break;
    case DType::bf16: type = CUDA_R_16BF; compute = CUBLAS_COMPUTE_32F; break;
    default: MT_THROW("cuBLAS GEMM: expected f32, f64 or bf16, got {}", dtype);
  }
  // alpha/beta in the compute type's scalar type.
  float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  const void* pa = dtype == DType::f64 ? static_cast<const void*>(&alpha) : &alpha_f;
  const void* pb = dtype == DType::f64 ? static_cast<const void*>(&beta) : &beta_f;
  cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // Column-major: C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m).
  MT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle(device), op_b, op_a, to_int(n, "N"), to_int(m, "M"), to_int(k, "K"), pa, b, type, to_int(ldb, "ldb"),
      stride_b, a, type, to_int(lda, "lda"), stride_a, pb, c, type, to_int(ldc, "ldc"), stride_c,
      to_int(batch, "batch"), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace moetrain::cuda
