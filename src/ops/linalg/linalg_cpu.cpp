#include "backend/cpu/blas.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/linalg/linalg_kernels.h"

namespace moetrain::cpu {

void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  dispatch_float(a.dtype(), "matmul", [&](auto tag) {
    using T = decltype(tag);
    int64_t m = out.size(-2), n = out.size(-1);
    int64_t k = trans_a ? a.size(-2) : a.size(-1);
    int64_t lda = a.size(-1), ldb = b.size(-1);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* pc = out.data<T>();
    if (b.dim() == 2 && (a.dim() == 2 || !trans_a)) {
      // All rows of a at once: [rows, K] x op(b).
      int64_t rows = a.dim() == 2 ? m : a.shape().numel(0, a.dim() - 1);
      gemm(trans_a, trans_b, rows, n, k, T(1), pa, lda, pb, ldb, T(0), pc, n);
      return;
    }
    int64_t batch = out.shape().numel(0, out.dim() - 2);
    int64_t a_step = a.dim() == 2 ? 0 : a.size(-2) * a.size(-1), c_step = m * n;
    int64_t b_step = b.dim() == 2 ? 0 : b.size(-2) * b.size(-1);
    auto one = [&](int64_t i) {
      gemm(trans_a, trans_b, m, n, k, T(1), pa + i * a_step, lda, pb + i * b_step, ldb, T(0), pc + i * c_step, n);
    };
    // Small matrices: one per thread (BLAS runs single-threaded inside); large: BLAS threads.
    if (m * n * k < (1 << 21)) {
      parallel_for(batch, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) one(i);
      });
    } else {
      for (int64_t i = 0; i < batch; ++i) one(i);
    }
  });
}

}  // namespace moetrain::cpu
