#include "ops/moe/moe.h"

#include <numeric>
#include <vector>

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

Tensor moe_combine(const Tensor& rows, const std::vector<int64_t>& slot_rows, const Tensor& weights) {
  check_float("moe_combine", "rows", rows);
  check_same_kind("moe_combine", rows, weights);
  check_rank("moe_combine", "rows", rows, 2);
  check_rank("moe_combine", "weights", weights, 2);
  const int64_t M = rows.size(0), N = weights.size(0), k = weights.size(1);
  MT_CHECK(static_cast<int64_t>(slot_rows.size()) == N * k,
           "moe_combine: {} slot rows for weights {} (one per token and slot: {})", slot_rows.size(), weights.shape(),
           N * k);
  std::vector<char> named(static_cast<size_t>(M), 0);
  int64_t num_named = 0;
  for (int64_t r : slot_rows) {
    MT_CHECK(r >= 0 && r <= M, "moe_combine: slot row {} outside [0, {}] for rows {} ({} = dropped)", r, M,
             rows.shape(), M);
    MT_CHECK(r == M || !named[r], "moe_combine: row {} is named by two slots (each row holds one slot's output)", r);
    if (r < M) named[r] = 1, ++num_named;
  }
  const bool all_named = num_named == M;  // else the backward's unnamed rows start from zeros
  Tensor rc = rows.contiguous(), wc = weights.contiguous();
  // The kernel reads the slot rows where rows lives.
  Tensor index = from_span<int64_t>(slot_rows, {N * k}).to(rows.device());
  Tensor y = empty({N, rows.size(1)}, rows.dtype(), rows.device());
  MT_ON_DEVICE(rows, moe_combine_forward, y, rc, index, wc);
  return record("moe_combine", y, {rows, weights}, [rc, wc, index, all_named](const Tensor& dy) {
    Tensor grad_rows =
        all_named ? empty(rc.shape(), dy.dtype(), dy.device()) : zeros(rc.shape(), dy.dtype(), dy.device());
    Tensor grad_weights = empty(wc.shape(), dy.dtype(), dy.device());
    Tensor dyc = dy.contiguous();
    MT_ON_DEVICE(dyc, moe_combine_backward, grad_rows, grad_weights, dyc, rc, index, wc);
    return Grads{grad_rows, grad_weights};
  });
}

}  // namespace moetrain
