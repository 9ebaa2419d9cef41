// Backward (docs/model.md#decay-gate), with a = exp(A_log[h]), u = f + dt_bias:
//   softplus gate:  ∂g/∂f = -a σ(u),         ∂g/∂A_log = g
//   lower bound:    ∂g/∂f = lb s(1 - s) a,   ∂g/∂A_log = ∂g/∂f · u,   s = σ(a u)
// d dt_bias sums dg ∂g/∂f over every row, d A_log also over K (the reduce op's
// fixed order: deterministic on both backends).
#include "ops/kda/decay_gate.h"

#include <cmath>

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/kda/decay_gate_kernels.h"
#include "ops/reduce/reduce.h"
#include "ops/view/view.h"

namespace moetrain {

Tensor decay_gate(const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, std::optional<double> lower_bound) {
  check_float("decay_gate", "f", f);
  check_rank("decay_gate", "f", f, -2);
  check_same_kind("decay_gate", f, A_log);
  check_same_kind("decay_gate", f, dt_bias);
  const int64_t H = f.size(-2), K = f.size(-1);
  MT_CHECK(A_log.shape() == Shape{H} && dt_bias.shape() == Shape{H * K},
           "decay_gate: A_log is {} and dt_bias {} but f is {} ([..., H, K]); they must be [{}] and [{}]",
           A_log.shape(), dt_bias.shape(), f.shape(), H, H * K);
  MT_CHECK(!lower_bound || (std::isfinite(*lower_bound) && *lower_bound != 0.0),
           "decay_gate: the lower bound must be a finite non-zero number, got {}", lower_bound.value_or(0.0));
  const double lb = lower_bound.value_or(0.0);
  Tensor g = empty_like(f);
  MT_ON_DEVICE(f, decay_gate_forward, g, f, A_log, dt_bias, lb);
  const Tensor g_saved = g.detach();  // the softplus gate's ∂g/∂A_log (no reference cycle)
  return record("decay_gate", g, {f, A_log, dt_bias}, [f, A_log, dt_bias, g_saved, lb, H, K](const Tensor& grad_g) {
    Tensor grad_f = empty_like(f), grad_a;
    if (A_log.requires_grad()) grad_a = empty_like(f);
    Tensor* ga = grad_a.defined() ? &grad_a : nullptr;
    MT_ON_DEVICE(f, decay_gate_backward, grad_f, ga, grad_g, g_saved, f, A_log, dt_bias, lb);
    const int64_t rows = f.numel() / std::max<int64_t>(H * K, 1);
    Tensor grad_A_log, grad_dt_bias;
    if (ga) grad_A_log = sum(sum(reshape(grad_a, {rows, H, K}), 2), 0);
    if (dt_bias.requires_grad()) grad_dt_bias = sum(reshape(grad_f, {rows, H * K}), 0);
    return Grads{grad_f, grad_A_log, grad_dt_bias};
  });
}

}  // namespace moetrain
