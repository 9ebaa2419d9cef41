#include "ops/common/checks.h"

namespace moetrain {

void check_float(const char* op, const char* arg, const Tensor& t) {
  MT_CHECK(t.defined(), "{}: {} is undefined", op, arg);
  // bf16 on the CPU: matrix products through oneDNN, the other kernels widened to
  // f32 (ops/common/bf16_widen.h); on CUDA in f32 registers.
  MT_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::bf16,
           "{}: {} is {}; expected f32, f64 or bf16", op, arg, describe(t));
}

void check_same_kind(const char* op, const Tensor& a, const Tensor& b) {
  MT_CHECK(a.dtype() == b.dtype(), "{}: dtype mismatch, {} vs {}", op, describe(a), describe(b));
  MT_CHECK(a.device() == b.device(), "{}: device mismatch, {} vs {}", op, describe(a), describe(b));
}

void check_rank(const char* op, const char* arg, const Tensor& t, int rank) {
  if (rank >= 0)
    MT_CHECK(t.dim() == rank, "{}: {} must have rank {}, got {}", op, arg, rank, describe(t));
  else
    MT_CHECK(t.dim() >= -rank, "{}: {} must have rank >= {}, got {}", op, arg, -rank, describe(t));
}

DType stats_dtype(const Tensor& t) { return t.dtype() == DType::bf16 ? DType::f32 : t.dtype(); }

void check_cpu(const char* op, const Tensor& t) {
  MT_CHECK(t.is_cpu(), "{}: {} is on {}, and this op has no CUDA kernel in this build; move it with .to(kCpu)",
           op, describe(t), t.device());
}

}  // namespace moetrain
