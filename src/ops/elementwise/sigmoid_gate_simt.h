// The per-element arithmetic of the CUDA sigmoid_gate kernels (elementwise_cuda.cu),
// written once for the GPU and the host so tests run it on the CPU
// (tests/ops/sigmoid_gate_test.cpp). In the compute type A (float for bf16 storage).
// σ(z) = 1 / (1 + e^{-z}) as the CUDA sigmoid kernel computes it, and the products in
// the order of the unfused sequence the op replaces (sigmoid, mul; backward: mul's
// grad_y σ(z) and grad_y x, then sigmoid's (grad_y x) (σ (1 - σ))), so in f32 and f64
// the fused kernels give the unfused kernels' bits.
#pragma once

#include "ops/common/simt.h"

namespace moetrain::simt {

template <class A> MT_HOST_DEVICE inline A gate_sigmoid(A z) { return A(1) / (A(1) + exp_a(-z)); }

template <class A> MT_HOST_DEVICE inline A sigmoid_gate_value(A x, A z) { return x * gate_sigmoid(z); }

template <class A> MT_HOST_DEVICE inline void sigmoid_gate_grads(A grad_y, A x, A z, A& grad_x, A& grad_z) {
  const A s = gate_sigmoid(z);
  grad_x = grad_y * s;
  grad_z = (grad_y * x) * (s * (A(1) - s));
}

}  // namespace moetrain::simt
