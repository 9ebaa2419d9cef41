// cuBLAS calls (compiled only with the CUDA backend): one handle per device,
// bound to the device's stream. Row-major C = op(A) op(B) is column-major
// C^T = op(B)^T op(A)^T, so the operands swap and the transposes stay.
#include "backend/cuda/cublas.h"

#include <array>
#include <atomic>
#include <mutex>
#include <vector>

#include <cublas_v2.h>

#include "backend/cuda/check.h"
#include "backend/cuda/runtime.h"
#include "core/launch_count.h"

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

// The cuBLAS data and compute types of a GEMM in `dtype`.
std::pair<cudaDataType_t, cublasComputeType_t> gemm_types(DType dtype) {
  switch (dtype) {
    case DType::f32: return {CUDA_R_32F, g_allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
    case DType::f64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::bf16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    default: MT_THROW("cuBLAS GEMM: expected f32, f64 or bf16, got {}", dtype);
  }
}

}  // namespace

void set_allow_tf32(bool on) { g_allow_tf32 = on; }
bool allow_tf32() { return g_allow_tf32; }

void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void* a,
          int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, double beta, void* c,
          int64_t ldc, int64_t stride_c, int64_t batch, int device) {
  if (m == 0 || n == 0 || batch == 0) return;
  const auto [type, compute] = gemm_types(dtype);
  // alpha/beta in the compute type's scalar type.
  float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  const void* pa = dtype == DType::f64 ? static_cast<const void*>(&alpha) : &alpha_f;
  const void* pb = dtype == DType::f64 ? static_cast<const void*>(&beta) : &beta_f;
  cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // Column-major: C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m).
  count_cuda_library_call();
  MT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle(device), op_b, op_a, to_int(n, "N"), to_int(m, "M"), to_int(k, "K"), pa, b, type, to_int(ldb, "ldb"),
      stride_b, a, type, to_int(lda, "lda"), stride_a, pb, c, type, to_int(ldc, "ldc"), stride_c,
      to_int(batch, "batch"), compute, CUBLAS_GEMM_DEFAULT));
}

void gemm_grouped(DType dtype, bool trans_a, bool trans_b, const std::vector<GemmItem>& items, int device) {
  std::vector<GemmItem> live;
  for (const GemmItem& it : items)
    if (it.m > 0 && it.n > 0) live.push_back(it);
  if (live.empty()) return;
  if (dtype == DType::f64 || live.size() == 1) {  // the grouped call takes f32, f16 and bf16
    for (const GemmItem& it : live)
      gemm(dtype, trans_a, trans_b, it.m, it.n, it.k, 1.0, it.a, it.lda, 0, it.b, it.ldb, 0, 0.0, it.c, it.ldc, 0, 1,
           device);
    return;
  }
  const auto [type, compute] = gemm_types(dtype);
  const int groups = to_int(static_cast<int64_t>(live.size()), "groups");
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // One problem per group, column-major as in gemm(): C^T = op(B)^T op(A)^T.
  std::vector<cublasOperation_t> first(static_cast<size_t>(groups), op_b), second(static_cast<size_t>(groups), op_a);
  std::vector<int> rows(live.size()), cols(live.size()), depth(live.size()), ld_first(live.size()),
      ld_second(live.size()), ld_c(live.size()), group_size(live.size(), 1);
  std::vector<float> alpha(live.size(), 1.0f), beta(live.size(), 0.0f);
  std::vector<const void*> pointers(3 * live.size());  // the first operands, the second, the outputs
  for (size_t i = 0; i < live.size(); ++i) {
    const GemmItem& it = live[i];
    rows[i] = to_int(it.n, "N");
    cols[i] = to_int(it.m, "M");
    depth[i] = to_int(it.k, "K");
    ld_first[i] = to_int(it.ldb, "ldb");
    ld_second[i] = to_int(it.lda, "lda");
    ld_c[i] = to_int(it.ldc, "ldc");
    pointers[i] = it.b;
    pointers[live.size() + i] = it.a;
    pointers[2 * live.size() + i] = it.c;
  }
  // cuBLAS reads the operand pointers from device memory (written on the stream
  // from kernel arguments: no wait for the GPU); the sizes from the host.
  const int64_t bytes = static_cast<int64_t>(pointers.size() * sizeof(void*));
  void* on_device = device_malloc(bytes, device);
  write_pointers(static_cast<void* const*>(on_device), pointers.data(), static_cast<int64_t>(pointers.size()), device);
  const void* const* dev = static_cast<const void* const*>(on_device);
  void* const* outputs = static_cast<void* const*>(on_device) + 2 * groups;
  count_cuda_library_call();
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(
      handle(device), first.data(), second.data(), rows.data(), cols.data(), depth.data(), alpha.data(), dev, type,
      ld_first.data(), dev + groups, type, ld_second.data(), beta.data(), outputs, type, ld_c.data(), groups,
      group_size.data(), compute);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // a type/compute pair this cuBLAS does not group: one GEMM each
    for (const GemmItem& it : live)
      gemm(dtype, trans_a, trans_b, it.m, it.n, it.k, 1.0, it.a, it.lda, 0, it.b, it.ldb, 0, 0.0, it.c, it.ldc, 0, 1,
           device);
  } else {
    MT_CUBLAS_CHECK(st);
  }
  device_free(on_device, device);  // the stream orders any reuse after the GEMMs
}

}  // namespace moetrain::cuda
