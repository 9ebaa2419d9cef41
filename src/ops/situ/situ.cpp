#include "ops/situ/situ.h"

#include <cmath>

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/situ/situ_kernels.h"

namespace moetrain {

namespace {

void check_args(const Tensor& gate, const Tensor& up, double beta, std::optional<double> linear_beta) {
  check_float("situ_glu", "gate", gate);
  check_float("situ_glu", "up", up);
  check_same_kind("situ_glu", gate, up);
  MT_CHECK(gate.shape() == up.shape(), "situ_glu: gate {} and up {} must have the same shape", gate.shape(),
           up.shape());
  MT_CHECK(beta > 0 && std::isfinite(beta), "situ_glu: beta must be a finite number > 0, got {}", beta);
  MT_CHECK(!linear_beta || (*linear_beta > 0 && std::isfinite(*linear_beta)),
           "situ_glu: linear_beta must be a finite number > 0, got {}", linear_beta.value_or(0.0));
}

}  // namespace

Tensor situ_glu(const Tensor& gate, const Tensor& up, double beta, std::optional<double> linear_beta) {
  check_args(gate, up, beta, linear_beta);
  double lambda = linear_beta.value_or(0.0);
  Tensor out = empty_like(gate);
  MT_ON_DEVICE(gate, situ_glu_forward, out, gate, up, beta, lambda);
  return record("situ_glu", out, {gate, up}, [gate, up, beta, lambda](const Tensor& grad_out) {
    Tensor grad_gate = empty_like(gate), grad_up = empty_like(up);
    MT_ON_DEVICE(gate, situ_glu_backward, grad_gate, grad_up, nullptr, grad_out, gate, up, beta, lambda);
    return Grads{grad_gate, grad_up};
  });
}

Tensor situ_glu(const Tensor& gate, const Tensor& up, const Tensor& beta, std::optional<double> linear_beta) {
  MT_CHECK(beta.defined() && beta.numel() == 1 && beta.dim() <= 1,
           "situ_glu: a learnable beta must be a one-element tensor, got {}",
           beta.defined() ? beta.shape() : Shape{});
  check_same_kind("situ_glu", gate, beta);
  // The kernels take β as a number: for a CUDA β this copies one element to the
  // host (and waits for the stream).
  double b = beta.to(kCpu).item<double>();
  check_args(gate, up, b, linear_beta);
  double lambda = linear_beta.value_or(0.0);
  Tensor out = empty_like(gate);
  MT_ON_DEVICE(gate, situ_glu_forward, out, gate, up, b, lambda);
  return record("situ_glu", out, {gate, up, beta}, [gate, up, beta, b, lambda](const Tensor& grad_out) {
    Tensor grad_gate = empty_like(gate), grad_up = empty_like(up), grad_beta;
    if (gate.is_cuda()) {  // dβ is reduced on the device, into grad_beta
      if (beta.requires_grad()) grad_beta = empty(beta.shape(), beta.dtype(), beta.device());
      cuda::situ_glu_backward(grad_gate, grad_up, grad_beta.defined() ? &grad_beta : nullptr, grad_out, gate, up, b,
                              lambda);
      return Grads{grad_gate, grad_up, grad_beta};
    }
    double gb = 0;
    cpu::run_kernel("situ_glu_backward", &cpu::situ_glu_backward, grad_gate, grad_up,
                    beta.requires_grad() ? &gb : nullptr, grad_out, gate, up, b, lambda);
    if (beta.requires_grad()) grad_beta = full(beta.shape(), gb, beta.dtype(), beta.device());
    return Grads{grad_gate, grad_up, grad_beta};
  });
}

}  // namespace moetrain
