// The engine's gradient sums (autograd/grad_sum.h), on the elementwise kernels.
#include "autograd/grad_sum.h"

#include "ops/elementwise/elementwise.h"

namespace moetrain::autograd {

Tensor grad_sum(const Tensor& a, const Tensor& b) {
  if (a.dtype() != DType::bf16) return add(a, b);
  return add(a.to(DType::f32), b.to(DType::f32)).to(DType::bf16);
}

void grad_add_(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == DType::bf16) copy_(dst, grad_sum(dst, src));
  else add_(dst, src);
}

}  // namespace moetrain::autograd
