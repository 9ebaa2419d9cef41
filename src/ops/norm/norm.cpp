// Norm ops. Backward (docs/model.md#norms), per row with x̂ = normalised x, g = dy ⊙ w:
//   LayerNorm: dx = r (g - mean(g) - x̂ mean(g ⊙ x̂)),  dw = Σ dy ⊙ x̂,  db = Σ dy
//   RMSNorm:   dx = r (g - x̂ mean(g ⊙ x̂)),            dw = Σ dy ⊙ x̂
//   L2 norm:   dx = r (dy - y (y · dy))
//   gated RMSNorm, y = ŷ ⊙ σ(z) with ŷ the RMSNorm: the RMSNorm formulas with
//              dy σ(z) for dy, and dz = dy ŷ σ(z)(1 - σ(z)). The gate may be bf16
//              under f32 x (KDA's bf16 gate projection, mixed precision): read as it
//              is and dz written in bf16, the cast to f32 and its backward fused
//              (the same bits as casting first: one rounding of dz either way).
//   residual add + norm, h = x + d, y = norm(h): dx = dd = dh + (the norm's dx at h)
#include "ops/norm/norm.h"

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/norm/norm_kernels.h"

namespace moetrain {

namespace {
void check_weight(const char* op, const char* arg, const Tensor& x, const Tensor& w) {
  if (!w.defined()) return;
  MT_CHECK(w.shape() == Shape{x.size(-1)}, "{}: {} is {} but x is {}; {} must be [{}]", op, arg, w.shape(), x.shape(),
           arg, x.size(-1));
  check_same_kind(op, x, w);
}
}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_float("layer_norm", "x", x);
  check_rank("layer_norm", "x", x, -1);
  check_weight("layer_norm", "weight", x, weight);
  check_weight("layer_norm", "bias", x, bias);
  Tensor y = empty_like(x);
  Shape stats = x.shape().drop_last();
  Tensor mean = empty(stats, stats_dtype(x), x.device()), rstd = empty(stats, stats_dtype(x), x.device());
  MT_ON_DEVICE(x, layer_norm_forward, y, mean, rstd, x, weight, bias, eps);
  return record("layer_norm", y, {x, weight, bias}, [x, weight, bias, mean, rstd](const Tensor& grad_y) {
    Tensor grad_x = empty_like(x), grad_w, grad_b;
    if (weight.defined() && weight.requires_grad()) grad_w = empty_like(weight);
    if (bias.defined() && bias.requires_grad()) grad_b = empty_like(bias);
    Tensor* gw = grad_w.defined() ? &grad_w : nullptr;
    Tensor* gb = grad_b.defined() ? &grad_b : nullptr;
    MT_ON_DEVICE(x, layer_norm_backward, grad_x, gw, gb, grad_y, x, weight, mean, rstd);
    return Grads{grad_x, grad_w, grad_b};
  });
}

namespace {
Tensor scaled_norm(const char* op, const Tensor& x, const Tensor& weight, const Tensor& gate, double scale,
                   double eps) {
  check_float(op, "x", x);
  check_rank(op, "x", x, -1);
  check_weight(op, "weight", x, weight);
  if (gate.defined()) {
    MT_CHECK(gate.shape() == x.shape(), "{}: gate is {} but x is {}; they must have the same shape", op,
             gate.shape(), x.shape());
    // A bf16 gate under f32 x: the gate's cast to f32 is fused (gated RMSNorm in the comment above).
    if (!(x.dtype() == DType::f32 && gate.dtype() == DType::bf16)) check_same_kind(op, x, gate);
    MT_CHECK(gate.device() == x.device(), "{}: gate on {} but x on {}", op, gate.device(), x.device());
  }
  Tensor y = empty_like(x);
  Tensor rstd = empty(x.shape().drop_last(), stats_dtype(x), x.device());
  MT_ON_DEVICE(x, scaled_norm_forward, y, rstd, x, weight, gate, scale, eps);
  return record(op, y, {x, weight, gate}, [x, weight, gate, rstd, scale](const Tensor& grad_y) {
    Tensor grad_x = empty_like(x), grad_w, grad_z;
    if (weight.defined() && weight.requires_grad()) grad_w = empty_like(weight);
    if (gate.defined() && gate.requires_grad()) grad_z = empty_like(gate);
    Tensor* gw = grad_w.defined() ? &grad_w : nullptr;
    Tensor* gz = grad_z.defined() ? &grad_z : nullptr;
    MT_ON_DEVICE(x, scaled_norm_backward, grad_x, gw, gz, grad_y, x, weight, gate, rstd, scale);
    return Grads{grad_x, grad_w, grad_z};
  });
}
double rms_scale(const Tensor& x) { return 1.0 / static_cast<double>(x.defined() ? x.size(-1) : 1); }
}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return scaled_norm("rms_norm", x, weight, Tensor(), rms_scale(x), eps);
}

Tensor gated_rms_norm(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps) {
  MT_CHECK(gate.defined(), "gated_rms_norm: the gate is undefined (use rms_norm for no gate)");
  return scaled_norm("gated_rms_norm", x, weight, gate, rms_scale(x), eps);
}

Tensor l2_norm(const Tensor& x, double eps) { return scaled_norm("l2_norm", x, Tensor(), Tensor(), 1.0, eps); }

namespace {
void check_residual(const char* op, const Tensor& x, const Tensor& delta) {
  check_float(op, "x", x);
  check_rank(op, "x", x, -1);
  MT_CHECK(delta.defined(), "{}: the residual delta is undefined (x is {})", op, x.shape());
  MT_CHECK(delta.shape() == x.shape(), "{}: the residual delta is {} but x is {}; they must have the same shape", op,
           delta.shape(), x.shape());
  check_same_kind(op, x, delta);
}
}  // namespace

ResidualNorm add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                            double eps) {
  check_residual("add_layer_norm", x, delta);
  check_weight("add_layer_norm", "weight", x, weight);
  check_weight("add_layer_norm", "bias", x, bias);
  Tensor h = empty_like(x), y = empty_like(x);
  Shape stats = x.shape().drop_last();
  Tensor mean = empty(stats, stats_dtype(x), x.device()), rstd = empty(stats, stats_dtype(x), x.device());
  MT_ON_DEVICE(x, add_layer_norm_forward, h, y, mean, rstd, x, delta, weight, bias, eps);
  const Tensor saved_h = h.detach();  // an output: saved detached (autograd/node.h)
  Tensors out = autograd::record(
      "add_layer_norm", {h, y}, {x, delta, weight, bias}, [saved_h, weight, bias, mean, rstd](const Tensors& g) {
        Tensor grad_x = empty_like(saved_h), grad_w, grad_b;
        if (weight.defined() && weight.requires_grad()) grad_w = empty_like(weight);
        if (bias.defined() && bias.requires_grad()) grad_b = empty_like(bias);
        Tensor* gw = grad_w.defined() ? &grad_w : nullptr;
        Tensor* gb = grad_b.defined() ? &grad_b : nullptr;
        MT_ON_DEVICE(saved_h, add_layer_norm_backward, grad_x, gw, gb, g[0], g[1], saved_h, weight, mean, rstd);
        return Grads{grad_x, grad_x, grad_w, grad_b};
      });
  return {out[0], out[1]};
}

ResidualNorm add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  check_residual("add_rms_norm", x, delta);
  check_weight("add_rms_norm", "weight", x, weight);
  const double scale = rms_scale(x);
  Tensor h = empty_like(x), y = empty_like(x);
  Tensor rstd = empty(x.shape().drop_last(), stats_dtype(x), x.device());
  MT_ON_DEVICE(x, add_scaled_norm_forward, h, y, rstd, x, delta, weight, scale, eps);
  const Tensor saved_h = h.detach();
  Tensors out =
      autograd::record("add_rms_norm", {h, y}, {x, delta, weight}, [saved_h, weight, rstd, scale](const Tensors& g) {
        Tensor grad_x = empty_like(saved_h), grad_w;
        if (weight.defined() && weight.requires_grad()) grad_w = empty_like(weight);
        Tensor* gw = grad_w.defined() ? &grad_w : nullptr;
        MT_ON_DEVICE(saved_h, add_scaled_norm_backward, grad_x, gw, g[0], g[1], saved_h, weight, rstd, scale);
        return Grads{grad_x, grad_x, grad_w};
      });
  return {out[0], out[1]};
}

}  // namespace moetrain
