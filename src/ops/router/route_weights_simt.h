// renormalize_rows (route_weights.h) on one row of k weights: the arithmetic of the CPU
// and the CUDA kernels (route_weights_cpu.cpp, route_weights_cuda.cu), written once
// for the host and the GPU. In the compute type A; w(j) and g(j) give w_j and
// grad_y_j in A. Divisions, as the unfused div did (y_j = w_j / (S + eps)).
#pragma once

#include <cstdint>

#include "ops/common/simt.h"

namespace moetrain::simt {

// S + eps = Σ_j w_j + eps, the sum in slot order.
MT_SIMT_BODY
template <class A, class LoadW>
MT_HOST_DEVICE inline A renormalize_denominator(LoadW w, int64_t k, A eps) {
  A s = A(0);
  for (int64_t j = 0; j < k; ++j) s += w(j);
  return s + eps;
}

// Σ_j grad_y_j y_j, y_j = w_j / den.
MT_SIMT_BODY
template <class A, class LoadW, class LoadG>
MT_HOST_DEVICE inline A renormalize_dot(LoadW w, LoadG g, int64_t k, A den) {
  A d = A(0);
  for (int64_t j = 0; j < k; ++j) d += g(j) * (w(j) / den);
  return d;
}

}  // namespace moetrain::simt
