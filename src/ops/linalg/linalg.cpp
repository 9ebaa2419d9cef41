// matmul and linear. Backward of C = op(A) op(B) (all through matmul itself):
//   dA = dC op(B)^T  -> matmul(dC, B, false, !tb)      (untransposed A)
//   dA = op(B) dC^T  -> matmul(B, dC, tb, true)        (transposed A)
//   dB = op(A)^T dC  -> matmul(A, dC, !ta, false)      (untransposed B)
//   dB = dC^T op(A)  -> matmul(dC, A, true, ta)        (transposed B)
// A rank-2 B shared over A's leading dims gets the sum over them.
#include "ops/linalg/linalg.h"

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg_kernels.h"
#include "ops/view/view.h"

namespace moetrain {

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  check_float("matmul", "a", a);
  check_float("matmul", "b", b);
  check_same_kind("matmul", a, b);
  check_rank("matmul", "a", a, -2);
  check_rank("matmul", "b", b, -2);
  int64_t m = trans_a ? a.size(-1) : a.size(-2), ka = trans_a ? a.size(-2) : a.size(-1);
  int64_t kb = trans_b ? b.size(-1) : b.size(-2), n = trans_b ? b.size(-2) : b.size(-1);
  MT_CHECK(ka == kb, "matmul: inner dimensions differ: a {}{} has K = {}, b {}{} has K = {}", a.shape(),
           trans_a ? " (transposed)" : "", ka, b.shape(), trans_b ? " (transposed)" : "", kb);
  if (a.dim() > 2 && b.dim() > 2) {
    bool same = a.dim() == b.dim();
    for (int d = 0; same && d < a.dim() - 2; ++d) same = a.size(d) == b.size(d);
    MT_CHECK(same, "matmul: batched operands need the same leading dims, got a {} and b {}", a.shape(), b.shape());
  }
  const Tensor& batched = a.dim() >= b.dim() ? a : b;
  Shape out_shape = batched.shape().with(-2, m).with(-1, n);
  Tensor out = empty(out_shape, a.dtype(), a.device());
  MT_ON_DEVICE(a, matmul_forward, out, a, b, trans_a, trans_b);
  return record("matmul", out, {a, b}, [a, b, trans_a, trans_b](const Tensor& g) {
    Tensor grad_a, grad_b;
    if (a.requires_grad()) {
      grad_a = trans_a ? matmul(b, g, trans_b, true) : matmul(g, b, false, !trans_b);
      if (grad_a.dim() > a.dim()) grad_a = sum_to(grad_a, a.shape());  // a was shared over the batch
    }
    if (b.requires_grad()) {
      if (b.dim() == 2 && a.dim() > 2 && !trans_a) {
        // One GEMM over all rows: flatten A and dC to matrices.
        Tensor a2 = reshape(a, {-1, a.size(-1)}), g2 = reshape(g, {-1, g.size(-1)});
        grad_b = trans_b ? matmul(g2, a2, true, false) : matmul(a2, g2, true, false);
      } else {
        grad_b = trans_b ? matmul(g, a, true, trans_a) : matmul(a, g, !trans_a, false);
        if (grad_b.dim() > b.dim()) grad_b = sum_to(grad_b, b.shape());  // b was shared over the batch
      }
    }
    return Grads{grad_a, grad_b};
  });
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_rank("linear", "weight", weight, 2);
  MT_CHECK(x.size(-1) == weight.size(1), "linear: input {} has {} features but weight {} expects {} ([out, in])",
           x.shape(), x.size(-1), weight.shape(), weight.size(1));
  Tensor y = matmul(x, weight, false, true);
  if (!bias.defined()) return y;
  MT_CHECK(bias.shape() == Shape{weight.size(0)}, "linear: bias is {} but weight {} needs [{}]", bias.shape(),
           weight.shape(), weight.size(0));
  return add(y, bias);
}

}  // namespace moetrain
