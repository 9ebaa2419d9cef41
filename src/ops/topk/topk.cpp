#include "ops/topk/topk.h"

#include "autograd/node.h"
#include "core/grad_mode.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/topk/topk_kernels.h"

namespace moetrain {

TopK topk(const Tensor& x, int64_t k) {
  check_float("topk", "x", x);
  check_rank("topk", "x", x, -1);
  MT_CHECK(k >= 1 && k <= x.size(-1), "topk: k = {} must be in [1, {}] for x {}", k, x.size(-1), x.shape());
  Shape out_shape = x.shape().with(-1, k);
  Tensor values = empty(out_shape, x.dtype(), x.device());
  Tensor indices = empty(out_shape, DType::i64, x.device());
  MT_ON_DEVICE(x, topk_forward, values, indices, x, k);
  Shape in_shape = x.shape();
  values = record("topk", values, {x}, [in_shape, indices](const Tensor& g) {
    Tensor grad_x = empty(in_shape, g.dtype(), g.device());
    MT_ON_DEVICE(g, scatter_last, grad_x, g, indices);
    return Grads{grad_x};
  });
  return {values, indices};
}

Tensor gather_last(const Tensor& x, const Tensor& index) {
  check_float("gather_last", "x", x);
  check_rank("gather_last", "x", x, -1);
  MT_CHECK(index.dtype() == DType::i64, "gather_last: index must be i64, got {}", describe(index));
  MT_CHECK(index.device() == x.device(), "gather_last: index {} must be on x's device ({})", describe(index),
           describe(x));
  MT_CHECK(index.dim() == x.dim() && index.shape().with(-1, 1) == x.shape().with(-1, 1),
           "gather_last: index {} must be x's shape {} but for the last dim", index.shape(), x.shape());
  const int64_t n = x.size(-1);
  const Tensor xc = x.contiguous(), ic = index.contiguous();
  if (!ic.is_cuda()) {
    const int64_t* p = ic.data<int64_t>();
    for (int64_t i = 0; i < ic.numel(); ++i)
      MT_CHECK(p[i] >= 0 && p[i] < n, "gather_last: index {} at position {} of index {} is outside [0, {}) for x {}",
               p[i], i, index.shape(), n, x.shape());
  }
  Tensor out = empty(index.shape(), x.dtype(), x.device());
  MT_ON_DEVICE(xc, gather_last_forward, out, xc, ic);
  const Shape in_shape = x.shape();
  return record("gather_last", out, {x}, [in_shape, ic](const Tensor& g) {
    Tensor grad_x = empty(in_shape, g.dtype(), g.device());
    const Tensor gc = g.contiguous();
    MT_ON_DEVICE(gc, scatter_last, grad_x, gc, ic);
    return Grads{grad_x};
  });
}

Tensor index_counts(const Tensor& index, int64_t n, DType dtype) {
  MT_CHECK(index.dtype() == DType::i64 && index.dim() >= 1 && n >= 1,
           "index_counts: index {} must be i64 [..., k] and n ({}) positive", describe(index), n);
  const Tensor ic = index.contiguous();
  if (!ic.is_cuda()) {
    const int64_t* p = ic.data<int64_t>();
    for (int64_t i = 0; i < ic.numel(); ++i)
      MT_CHECK(p[i] >= 0 && p[i] < n, "index_counts: index {} at position {} of index {} is outside [0, {})", p[i], i,
               index.shape(), n);
  }
  NoGradGuard no_grad;
  // scatter_last of ones: zeros, then one added at each index of the row.
  const Tensor ones = full(index.shape(), 1.0, dtype, index.device());
  Tensor counts = empty(index.shape().with(-1, n), dtype, index.device());
  MT_ON_DEVICE(ones, scatter_last, counts, ones, ic);
  return counts;
}

}  // namespace moetrain
