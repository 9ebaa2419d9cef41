// Test helpers: finite-difference gradient checks and tensor comparisons.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moetrain::testing {

struct GradCheckOptions {
  double eps = 1e-6;            // central-difference step
  double tolerance = 1e-6;      // max relative error allowed
  double floor = 1e-3;          // relative error = |a - n| / max(|a|, |n|, floor)
  std::vector<bool> check;      // which inputs to check (default: all floating ones)
  uint64_t seed = 12345;        // of the random upstream gradient
};

struct GradCheckResult {
  double max_rel_error = 0;
  std::string worst;  // "input 1 element 7: analytic .. numeric .."
};

// Checks the gradients of fn at `inputs` (f64 tensors) against central finite
// differences of L = sum_k <w_k, fn(inputs)_k> with random weights w_k, and
// REQUIREs the max relative error to be below opts.tolerance.
GradCheckResult check_gradients(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs,
                                GradCheckOptions opts = {});
GradCheckResult check_gradients(const std::function<Tensor(const Tensors&)>& fn, const Tensors& inputs,
                                GradCheckOptions opts = {});

double max_abs_diff(const Tensor& a, const Tensor& b);
// Bitwise equality of shape, dtype and contents.
bool bitwise_equal(const Tensor& a, const Tensor& b);

}  // namespace moetrain::testing
