// The check behind the ops' [cuda] tests: run an op on CUDA and on the CPU
// (its reference) from the same inputs, backward through autograd on both with
// the same upstream gradient, and compare the outputs and every gradient.
// For bf16 the CUDA run gets bf16 inputs and the CPU run f32 copies of the same
// (rounded) values, so only the CUDA side's arithmetic and bf16 stores differ.
#pragma once

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "moetrain.h"
#include "testing.h"

namespace moetrain::testing {

// max |a - b| / max |b| over two tensors of any device and dtype; NaN or a
// mismatch in NaN-ness counts as an infinite error.
inline double rel_error_nan(const Tensor& a, const Tensor& b) {
  std::vector<double> x = a.to(kCpu).to_vector(), y = b.to(kCpu).to_vector();
  REQUIRE(x.size() == y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) {
      if (std::isnan(x[i]) && std::isnan(y[i])) continue;
      return INFINITY;
    }
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

// `dtype`'s copy of x (f32 or f64 input): bf16 values widened to f32 for the CPU.
inline Tensor cpu_twin(const Tensor& x, DType dtype) {
  if (!is_floating(x.dtype())) return x;
  return dtype == DType::bf16 ? x.to(DType::bf16).to(DType::f32) : x.to(dtype);
}
inline Tensor cuda_twin(const Tensor& x, DType dtype) {
  if (!is_floating(x.dtype())) return x.to(kCuda);
  return x.to(dtype).to(kCuda);
}

struct CudaCompare {
  double forward_tol;   // on each output
  double backward_tol;  // on each gradient
};

// Runs fn on CPU and CUDA copies of `inputs` (f32 or f64 tensors on the CPU; integer
// ones pass through), in `dtype`; the floating inputs marked in `grad` require
// grad. Checks each output and each of those inputs' gradients against the CPU.
inline void check_cuda_matches_cpu(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs,
                                   const std::vector<bool>& grad, DType dtype, CudaCompare tol,
                                   uint64_t seed = 99) {
  REQUIRE(grad.size() == inputs.size());
  Tensors cpu_in, cuda_in;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor c = cpu_twin(inputs[i], dtype).detach(), g = cuda_twin(inputs[i], dtype).detach();
    if (grad[i]) {
      c.set_requires_grad(true);
      g.set_requires_grad(true);
    }
    cpu_in.push_back(c);
    cuda_in.push_back(g);
  }
  Tensors cpu_out = fn(cpu_in), cuda_out = fn(cuda_in);
  REQUIRE(cpu_out.size() == cuda_out.size());
  Tensors cpu_roots, cpu_grads, cuda_roots, cuda_grads;
  for (size_t k = 0; k < cpu_out.size(); ++k) {
    REQUIRE(cuda_out[k].is_cuda());
    REQUIRE(cuda_out[k].shape() == cpu_out[k].shape());
    double e = rel_error_nan(cuda_out[k], cpu_out[k]);
    INFO(fmt::format("output {} of {} in {}: relative error {}", k, cpu_out[k].shape(), dtype, e));
    CHECK(e <= tol.forward_tol);
    if (!cpu_out[k].requires_grad()) continue;
    Tensor w = randn(cpu_out[k].shape(), DType::f32, seed + k);
    cpu_roots.push_back(cpu_out[k]);
    cpu_grads.push_back(cpu_twin(w, dtype == DType::bf16 ? DType::bf16 : cpu_out[k].dtype()));
    cuda_roots.push_back(cuda_out[k]);
    cuda_grads.push_back(cuda_twin(w, cuda_out[k].dtype()));
  }
  if (cpu_roots.empty()) return;
  autograd::backward(cpu_roots, cpu_grads);
  autograd::backward(cuda_roots, cuda_grads);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!grad[i]) continue;
    Tensor gc = cpu_in[i].grad(), gg = cuda_in[i].grad();
    REQUIRE(gc.defined());
    REQUIRE(gg.defined());
    REQUIRE(gg.is_cuda());
    double e = rel_error_nan(gg, gc);
    INFO(fmt::format("gradient of input {} {} in {}: relative error {}", i, inputs[i].shape(), dtype, e));
    CHECK(e <= tol.backward_tol);
  }
}

inline void check_cuda_matches_cpu(const std::function<Tensor(const Tensors&)>& fn, const Tensors& inputs,
                                   const std::vector<bool>& grad, DType dtype, CudaCompare tol, uint64_t seed = 99) {
  check_cuda_matches_cpu([&](const Tensors& in) { return Tensors{fn(in)}; }, inputs, grad, dtype, tol, seed);
}

// The tolerances of the ops' [cuda] tests: f64 and f32 differ from the CPU
// kernels only in summation order and accumulation type; bf16 in its stores.
inline CudaCompare tolerance_for(DType dtype) {
  switch (dtype) {
    case DType::f64: return {1e-10, 1e-9};
    case DType::f32: return {2e-5, 2e-4};
    default: return {1e-2, 2e-2};
  }
}

}  // namespace moetrain::testing
