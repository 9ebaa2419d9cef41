// matmul and linear. Backward of C = op(A) op(B) (all through matmul itself):
//   dA = dC op(B)^T  -> matmul(dC, B, false, !tb)      (untransposed A)
//   dA = op(B) dC^T  -> matmul(B, dC, tb, true)        (transposed A)
//   dB = op(A)^T dC  -> matmul(A, dC, !ta, false)      (untransposed B)
//   dB = dC^T op(A)  -> matmul(dC, A, true, ta)        (transposed B)
// A rank-2 B shared over A's leading dims gets the sum over them.
// linear with a bias (and linear_gelu) is one op: y = act(x W^T + b), backward
//   grad_z = grad_y (act'(z)), grad_b = Σ_rows grad_z, grad_W = grad_z^T x, grad_x = grad_z W.
// mlp_gelu = linear(linear_gelu(x)) as one op: the projection's grad_x and the GELU's
// derivative come out of one kernel call (gelu_input_backward). docs/cuda.md,
// "cuBLASLt epilogues", says which cuBLASLt epilogue does what on CUDA.
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

namespace {

void check_linear(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_rank(op, "weight", weight, 2);
  MT_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1),
           "{}: input {} has {} features but weight {} expects {} ([out, in])", op, x.shape(),
           x.dim() >= 1 ? x.size(-1) : 0, weight.shape(), weight.size(1));
  if (!bias.defined()) return;
  MT_CHECK(bias.shape() == Shape{weight.size(0)}, "{}: bias is {} but weight {} needs [{}]", op, bias.shape(),
           weight.shape(), weight.size(0));
  check_float(op, "x", x);
  check_same_kind(op, x, weight);
  check_same_kind(op, x, bias);
}

// y = act(x W^T + b) as one recorded op. Saved for backward: x, W (as matmul
// saves them) and, with GELU, the pre-activation z; not y.
Tensor linear_bias(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act) {
  const Shape out_shape = x.shape().with(-1, weight.size(0));
  Tensor y = empty(out_shape, x.dtype(), x.device());
  Tensor z = act == Activation::none ? Tensor{} : empty(out_shape, x.dtype(), x.device());
  MT_ON_DEVICE(x, linear_forward, y, z, x, weight, bias, act);
  return record(op, y, {x, weight, bias}, [x, weight, bias, z, act](const Tensor& g) {
    Tensor grad_x = x.requires_grad() ? empty_like(x) : Tensor{};
    Tensor grad_w = weight.requires_grad() ? empty_like(weight) : Tensor{};
    Tensor grad_b = bias.requires_grad() ? empty_like(bias) : Tensor{};
    MT_ON_DEVICE(x, linear_backward, grad_x, grad_w, grad_b, g, x, weight, z, act);
    return Grads{grad_x, grad_w, grad_b};
  });
}

}  // namespace

Tensor mlp_gelu(const Tensor& x, const Tensor& w_fc, const Tensor& b_fc, const Tensor& w_proj, const Tensor& b_proj) {
  MT_CHECK(b_fc.defined() && b_proj.defined(), "mlp_gelu: both biases are required (w_fc {}, w_proj {})",
           w_fc.shape(), w_proj.shape());
  check_linear("mlp_gelu", x, w_fc, b_fc);
  check_rank("mlp_gelu", "w_proj", w_proj, 2);
  MT_CHECK(w_proj.size(1) == w_fc.size(0), "mlp_gelu: w_proj {} must take the {} features of w_fc {} ([out, {}])",
           w_proj.shape(), w_fc.size(0), w_fc.shape(), w_fc.size(0));
  MT_CHECK(b_proj.shape() == Shape{w_proj.size(0)}, "mlp_gelu: b_proj is {} but w_proj {} needs [{}]",
           b_proj.shape(), w_proj.shape(), w_proj.size(0));
  check_same_kind("mlp_gelu", x, w_proj);
  check_same_kind("mlp_gelu", x, b_proj);
  const Shape hidden_shape = x.shape().with(-1, w_fc.size(0));
  Tensor z = empty(hidden_shape, x.dtype(), x.device()), m = empty(hidden_shape, x.dtype(), x.device());
  Tensor y = empty(x.shape().with(-1, w_proj.size(0)), x.dtype(), x.device()), unused;
  MT_ON_DEVICE(x, linear_forward, m, z, x, w_fc, b_fc, Activation::gelu_tanh);
  MT_ON_DEVICE(x, linear_forward, y, unused, m, w_proj, b_proj, Activation::none);
  return record("mlp_gelu", y, {x, w_fc, b_fc, w_proj, b_proj}, [x, w_fc, b_fc, w_proj, b_proj, z, m](const Tensor& g) {
    Tensor none;  // an output not asked for, or the unused pre-activation
    Tensor grad_wp = w_proj.requires_grad() ? empty_like(w_proj) : Tensor{};
    Tensor grad_bp = b_proj.requires_grad() ? empty_like(b_proj) : Tensor{};
    MT_ON_DEVICE(x, linear_backward, none, grad_wp, grad_bp, g, m, w_proj, none, Activation::none);
    Tensor grad_x, grad_wf, grad_bf;
    if (x.requires_grad() || w_fc.requires_grad() || b_fc.requires_grad()) {
      Tensor grad_z = empty_like(z);
      grad_bf = b_fc.requires_grad() ? empty_like(b_fc) : Tensor{};
      MT_ON_DEVICE(x, gelu_input_backward, grad_z, grad_bf, g, w_proj, z);
      grad_x = x.requires_grad() ? empty_like(x) : Tensor{};
      grad_wf = w_fc.requires_grad() ? empty_like(w_fc) : Tensor{};
      Tensor no_bias;
      MT_ON_DEVICE(x, linear_backward, grad_x, grad_wf, no_bias, grad_z, x, w_fc, none, Activation::none);
    }
    return Grads{grad_x, grad_wf, grad_bf, grad_wp, grad_bp};
  });
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_linear("linear", x, weight, bias);
  if (!bias.defined()) return matmul(x, weight, false, true);
  return linear_bias("linear", x, weight, bias, Activation::none);
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  MT_CHECK(bias.defined(), "linear_gelu: bias is required (weight {}); use gelu_tanh(linear(x, w)) without one",
           weight.shape());
  check_linear("linear_gelu", x, weight, bias);
  return linear_bias("linear_gelu", x, weight, bias, Activation::gelu_tanh);
}

}  // namespace moetrain
