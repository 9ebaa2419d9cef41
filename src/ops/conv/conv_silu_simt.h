// SiLU fused into the causal conv kernels (conv_silu.h): the per-element arithmetic of
// the CUDA kernels (conv_cuda.cu), written once for the GPU and the host so the tests
// run it on the CPU (tests/ops/conv/conv_silu_test.cpp). In the compute type A. The
// formulas of the CUDA unary kernels (elementwise_cuda.cu: sigmoid 1 / (1 + e^{-a}),
// silu a σ(a), its derivative σ (1 + a (1 - σ))), so with the conv's sum kept in A
// the fused kernels give the unfused sequence's bits in f32 and f64.
#pragma once

#include "ops/common/simt.h"

namespace moetrain::simt {

template <class A> MT_HOST_DEVICE inline A conv_silu_value(A a) { return a * (A(1) / (A(1) + exp_a(-a))); }

// d silu(a) / da.
template <class A> MT_HOST_DEVICE inline A conv_silu_derivative(A a) {
  const A s = A(1) / (A(1) + exp_a(-a));
  return s * (A(1) + a * (A(1) - s));
}

}  // namespace moetrain::simt
