#include "ops/moe/moe.h"

#include <numeric>

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/moe/moe_kernels.h"

namespace moetrain {

Tensor grouped_linear(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  check_float("grouped_linear", "x", x);
  check_same_kind("grouped_linear", x, w);
  check_rank("grouped_linear", "x", x, 2);
  check_rank("grouped_linear", "w", w, 3);
  MT_CHECK(static_cast<int64_t>(counts.size()) == w.size(0),
           "grouped_linear: {} row counts for w {} ([E, out, in] with E = {})", counts.size(), w.shape(), w.size(0));
  MT_CHECK(w.size(2) == x.size(1), "grouped_linear: x {} and w {}: w must be [E, out, {}]", x.shape(), w.shape(),
           x.size(1));
  int64_t total = 0;
  for (int64_t c : counts) {
    MT_CHECK(c >= 0, "grouped_linear: negative row count {}", c);
    total += c;
  }
  MT_CHECK(total == x.size(0), "grouped_linear: row counts sum to {} but x {} has {} rows", total, x.shape(),
           x.size(0));
  Tensor xc = x.contiguous(), wc = w.contiguous();
  Tensor y = empty({x.size(0), w.size(1)}, x.dtype(), x.device());
  MT_ON_DEVICE(x, grouped_linear_forward, y, xc, wc, counts);
  return record("grouped_linear", y, {x, w}, [xc, wc, counts](const Tensor& dy) {
    Tensor dx = empty(xc.shape(), dy.dtype(), dy.device());
    Tensor dw = empty(wc.shape(), dy.dtype(), dy.device());
    Tensor dyc = dy.contiguous();
    MT_ON_DEVICE(dyc, grouped_linear_backward, dx, dw, dyc, xc, wc, counts);
    return Grads{dx, dw};
  });
}

}  // namespace moetrain
