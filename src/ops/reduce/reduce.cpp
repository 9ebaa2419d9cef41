// Reductions. Backward: sum -> broadcast of the gradient; mean -> the same over
// n; max -> the gradient placed at the saved argmax.
#include "ops/reduce/reduce.h"

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/elementwise/elementwise.h"
#include "ops/reduce/reduce_kernels.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

struct Split {
  int dim;
  int64_t outer, n, inner;
  Shape keep_shape, out_shape;
};

Split split_at(const Tensor& x, int64_t dim, bool keepdim) {
  Split s;
  s.dim = x.shape().normalize_dim(dim);
  s.outer = x.shape().numel(0, s.dim);
  s.n = x.size(s.dim);
  s.inner = x.shape().numel(s.dim + 1, x.dim());
  s.keep_shape = x.shape().with(s.dim, 1);
  std::vector<int64_t> dims;
  for (int i = 0; i < x.dim(); ++i)
    if (i != s.dim) dims.push_back(x.size(i));
  s.out_shape = keepdim ? s.keep_shape : Shape(dims);
  return s;
}

}  // namespace

Tensor sum(const Tensor& x, int64_t dim, bool keepdim) {
  check_float("sum", "x", x);
  Split s = split_at(x, dim, keepdim);
  Tensor y = empty(s.out_shape, x.dtype(), x.device());
  MT_ON_DEVICE(x, sum_dim, y, x, s.outer, s.n, s.inner);
  Shape in_shape = x.shape(), keep = s.keep_shape;
  return record("sum", y, {x}, [in_shape, keep](const Tensor& g) {
    return Grads{broadcast_to(reshape(g, keep), in_shape)};
  });
}

Tensor sum(const Tensor& x) {
  check_float("sum", "x", x);
  Tensor y = empty({}, x.dtype(), x.device());
  MT_ON_DEVICE(x, sum_all, y, x);
  Shape in_shape = x.shape();
  return record("sum_all", y, {x}, [in_shape](const Tensor& g) { return Grads{broadcast_to(g, in_shape)}; });
}

Tensor mean(const Tensor& x, int64_t dim, bool keepdim) {
  int64_t n = x.size(dim);
  MT_CHECK(n > 0, "mean: dim {} of {} is empty", dim, x.shape());
  return mul_scalar(sum(x, dim, keepdim), 1.0 / static_cast<double>(n));
}

Tensor mean(const Tensor& x) {
  MT_CHECK(x.numel() > 0, "mean: {} is empty", describe(x));
  return mul_scalar(sum(x), 1.0 / static_cast<double>(x.numel()));
}

namespace {
std::pair<Tensor, Tensor> max_impl(const Tensor& x, int64_t dim, bool keepdim, Split& s) {
  check_float("max", "x", x);
  s = split_at(x, dim, keepdim);
  MT_CHECK(s.n > 0, "max: dim {} of {} is empty", dim, x.shape());
  Tensor values = empty(s.out_shape, x.dtype(), x.device());
  Tensor indices = empty(s.out_shape, DType::i64, x.device());
  MT_ON_DEVICE(x, max_dim, values, indices, x, s.outer, s.n, s.inner);
  return {values, indices};
}
}  // namespace

Tensor max(const Tensor& x, int64_t dim, bool keepdim) {
  Split s;
  auto [values, indices] = max_impl(x, dim, keepdim, s);
  Shape in_shape = x.shape();
  return record("max", values, {x}, [in_shape, indices, s](const Tensor& g) {
    Tensor gx = zeros(in_shape, g.dtype(), g.device());
    MT_ON_DEVICE(gx, max_dim_backward, gx, g, indices, s.outer, s.n, s.inner);
    return Grads{gx};
  });
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  Split s;
  return max_impl(x, dim, keepdim, s).second;
}

int64_t count_non_finite(const Tensor& x) {
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64 && x.dtype() != DType::bf16) return 0;
  if (x.is_cuda()) return cpu::count_non_finite(x.to(kCpu));
  return cpu::count_non_finite(x);
}

}  // namespace moetrain
