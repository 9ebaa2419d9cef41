// CUDA twins of the linalg kernels (linalg_cpu.cpp): matmul as one strided-batched
// cuBLAS GEMM; linear with a bias (and GELU) as one cuBLASLt GEMM with an
// epilogue, plain cuBLAS plus the elementwise kernels where cuBLASLt refuses the
// shape (backend/cuda/cublaslt.h; docs/cuda.md, "cuBLASLt epilogues").
#include "ops/linalg/linalg_kernels.h"

#include "backend/cuda/cublas.h"
#include "backend/cuda/cublaslt.h"
#include "backend/cuda/kernel_utils.cuh"
#include "ops/elementwise/elementwise_kernels.h"

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

// x [R, in] w^T with y [R, out]: cuBLASLt's BIAS (y = x w^T + b) or GELU_AUX_BIAS
// (z = x w^T + b, y = gelu(z)). Otherwise the cuBLAS GEMM into z (or y), the
// broadcast add of b in place and gelu_tanh's kernel: the unfused ops' kernels.
void linear_forward(Tensor& y, Tensor& z, const Tensor& x, const Tensor& w, const Tensor& b, Activation act) {
  const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
  const int dev = y.device().index;
  const bool gelu = act == Activation::gelu_tanh;
  const LtGemm g = lt_linear_forward(x.dtype(), rows, in, out, gelu, x.raw_data(), w.raw_data(), b.raw_data(),
                                     y.raw_data(), gelu ? z.raw_data() : nullptr);
  if (lt_matmul(g, dev)) return;
  Tensor& pre = gelu ? z : y;
  gemm(x.dtype(), false, true, rows, out, in, 1.0, x.raw_data(), in, 0, w.raw_data(), in, 0, 0.0, pre.raw_data(),
       out, 0, 1, dev);
  binary_forward(BinaryOp::add, pre, pre, b);
  if (gelu) unary_forward(UnaryOp::gelu_tanh, y, z);
}

// grad_z = grad_y (none) or grad_y gelu'(z) (gelu_tanh's derivative kernel: the
// DGELU epilogue belongs to the GEMM that produces grad_y, the layer above's:
// mlp_gelu uses it through gelu_input_backward);
// grad_w = grad_z^T x with cuBLASLt's BGRADB giving grad_b = Σ_rows grad_z;
// grad_x = grad_z w (cuBLAS). Fallback: cuBLAS and sum_to's kernel.
void linear_backward(Tensor& grad_x, Tensor& grad_w, Tensor& grad_b, const Tensor& grad_y, const Tensor& x,
                     const Tensor& w, const Tensor& z, Activation act) {
  const int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
  const int dev = grad_y.device().index;
  Tensor gz = grad_y;
  if (act == Activation::gelu_tanh) {
    gz = empty_like(grad_y);
    unary_backward(UnaryOp::gelu_tanh, gz, grad_y, z, z);  // gelu_tanh's derivative reads x only
  }
  bool bias_done = !grad_b.defined();
  if (grad_w.defined()) {
    const LtGemm g = lt_linear_weight_grad(x.dtype(), rows, in, out, gz.raw_data(), x.raw_data(), grad_w.raw_data(),
                                           grad_b.defined() ? grad_b.raw_data() : nullptr);
    if (grad_b.defined() && lt_matmul(g, dev)) {
      bias_done = true;
    } else {
      gemm(x.dtype(), true, false, out, in, rows, 1.0, gz.raw_data(), out, 0, x.raw_data(), in, 0, 0.0,
           grad_w.raw_data(), in, 0, 1, dev);
    }
  }
  if (!bias_done) {
    Tensor rows_view = gz.reshape({rows, out});
    sum_to(grad_b, rows_view);
  }
  if (grad_x.defined())
    gemm(x.dtype(), false, false, rows, in, out, 1.0, gz.raw_data(), out, 0, w.raw_data(), in, 0, 0.0,
         grad_x.raw_data(), in, 0, 1, dev);
}

// grad_z = (grad_y w) gelu'(z), grad_b = Σ_rows grad_z: one cuBLASLt GEMM with
// DGELU_BGRAD (aux z). Fallback: the cuBLAS GEMM, gelu_tanh's derivative kernel,
// sum_to's kernel.
void gelu_input_backward(Tensor& grad_z, Tensor& grad_b, const Tensor& grad_y, const Tensor& w, const Tensor& z) {
  const int64_t in = w.size(1), out = w.size(0), rows = z.numel() / in;
  const int dev = z.device().index;
  if (grad_b.defined()) {
    const LtGemm g = lt_gelu_input_grad(z.dtype(), rows, in, out, grad_y.raw_data(), w.raw_data(), z.raw_data(),
                                        grad_z.raw_data(), grad_b.raw_data());
    if (lt_matmul(g, dev)) return;
  }
  Tensor grad_m = empty_like(z);
  gemm(z.dtype(), false, false, rows, in, out, 1.0, grad_y.raw_data(), out, 0, w.raw_data(), in, 0, 0.0,
       grad_m.raw_data(), in, 0, 1, dev);
  unary_backward(UnaryOp::gelu_tanh, grad_z, grad_m, z, z);  // gelu_tanh's derivative reads x only
  if (grad_b.defined()) {
    Tensor rows_view = grad_z.reshape({rows, in});
    sum_to(grad_b, rows_view);
  }
}

}  // namespace moetrain::cuda
