#include "ops/moe/moe.h"

#include <atomic>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/moe/grouped_gemm_tc_kernels.h"
#include "ops/moe/moe_kernels.h"
#include "ops/view/view.h"

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

namespace {

// The switch of set_grouped_gemm_tensor_cores, from MOETRAIN_GROUPED_GEMM at the first use.
std::atomic<bool>& grouped_tensor_cores() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("MOETRAIN_GROUPED_GEMM");
    const std::string s = v ? v : "";
    if (s.empty() || s == "auto") return true;
    if (s == "cublas") return false;
    throw Error(fmt::format("MOETRAIN_GROUPED_GEMM={}: expected auto (the default) or cublas", s));
  }()};
  return on;
}

bool device_offsets_gemm() { return grouped_tensor_cores().load(std::memory_order_relaxed); }

// The combine op on slot rows where rows lives; all_named: every row is some slot's
// (else the backward's unnamed rows start from zeros).
Tensor combine_rows(const Tensor& rows, const Tensor& index, const Tensor& weights, bool all_named) {
  check_same_kind("moe_combine", rows, weights);
  Tensor rc = rows.contiguous(), wc = weights.contiguous();
  Tensor y = empty({weights.size(0), rows.size(1)}, rows.dtype(), rows.device());
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

}  // namespace

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
  // The kernel reads the slot rows where rows lives.
  return combine_rows(rows, from_span<int64_t>(slot_rows, {N * k}).to(rows.device()), weights, num_named == M);
}

bool grouped_linear_offsets_on_device(const Tensor& x, const Tensor& w) {
  return x.is_cuda() && x.dtype() == DType::bf16 && w.dtype() == DType::bf16 && device_offsets_gemm();
}

void set_grouped_gemm_tensor_cores(bool on) { grouped_tensor_cores().store(on, std::memory_order_relaxed); }

ExpertRows plan_expert_rows(const Tensor& ids, int64_t num_experts, int64_t capacity) {
  MT_CHECK(ids.dtype() == DType::i64 && ids.dim() == 2, "plan_expert_rows: ids {} ({}) must be i64 [N, k]",
           ids.shape(), ids.dtype());
  const int64_t N = ids.size(0), k = ids.size(1), A = N * k;
  MT_CHECK(k >= 1 && k <= 64, "plan_expert_rows: top_k {} must be in [1, 64]", k);
  MT_CHECK(num_experts >= 1 && A < (int64_t{1} << 31),
           "plan_expert_rows: {} experts, {} assignments (at most 2^31 - 1 a layer)", num_experts, A);
  if (!ids.is_cuda()) {  // on the host the ids can be checked (the GPU's are the router's own)
    const int64_t* p = ids.data<int64_t>();
    for (int64_t a = 0; a < A; ++a)
      MT_CHECK(p[a] >= 0 && p[a] < num_experts, "plan_expert_rows: expert id {} at {} outside [0, {})", p[a], a,
               num_experts);
  }
  ExpertRows r;
  r.counts = empty({num_experts + 1}, DType::i64, ids.device());
  r.offsets = empty({num_experts + 1}, DType::i64, ids.device());
  r.row_token = empty({A}, DType::i64, ids.device());
  r.slot_row = empty({A}, DType::i64, ids.device());
  r.may_drop = capacity > 0;
  Tensor idc = ids.contiguous();
  MT_ON_DEVICE(idc, plan_expert_rows, r.counts, r.offsets, r.row_token, r.slot_row, idc, k, capacity);
  return r;
}

Tensor moe_gather(const Tensor& z, const ExpertRows& plan) {
  check_float("moe_gather", "z", z);
  check_rank("moe_gather", "z", z, 2);
  const int64_t N = z.size(0), W = z.size(1), A = plan.row_token.numel();
  MT_CHECK(plan.slot_row.numel() == A && (N == 0 ? A == 0 : A % N == 0) && plan.row_token.device() == z.device(),
           "moe_gather: z {} and a plan of {} rows (slot rows {}) on {}: one row per token and slot, where z is",
           z.shape(), A, plan.slot_row.numel(), plan.row_token.device());
  Tensor zc = z.contiguous();
  Tensor rows = empty({A, W}, z.dtype(), z.device());
  MT_ON_DEVICE(zc, moe_gather_forward, rows, zc, plan.row_token);
  return record("moe_gather", rows, {z}, [slot_row = plan.slot_row, N, W](const Tensor& g) {
    Tensor gz = empty({N, W}, g.dtype(), g.device());
    Tensor gc = g.contiguous();
    MT_ON_DEVICE(gc, moe_gather_backward, gz, gc, slot_row);
    return Grads{gz};
  });
}

Tensor grouped_linear(const Tensor& x, const Tensor& w, const Tensor& offsets) {
  check_rank("grouped_linear", "x", x, 2);
  check_rank("grouped_linear", "w", w, 3);
  const int64_t E = w.size(0), M = x.size(0);
  const bool on_device = grouped_linear_offsets_on_device(x, w);
  MT_CHECK(offsets.dtype() == DType::i64 && offsets.shape() == Shape{E + 1} &&
               (offsets.device() == x.device() || (!on_device && !offsets.is_cuda())),
           "grouped_linear: offsets {} ({}, on {}) must be i64 [{}] on {} (w {}: E = {})", offsets.shape(),
           offsets.dtype(), offsets.device(), E + 1, on_device ? x.device() : kCpu, w.shape(), E);
  if (on_device) {
    // Tensor cores reading the offsets on the device (grouped_gemm_tc.h): no wait.
    Tensor xc = x.contiguous(), wc = w.contiguous();
    Tensor y = empty({M, w.size(1)}, x.dtype(), x.device());
    cuda::grouped_linear_forward_dev(y, xc, wc, offsets);
    return record("grouped_linear", y, {x, w}, [xc, wc, offsets](const Tensor& dy) {
      Tensor dx = empty(xc.shape(), dy.dtype(), dy.device()), dw = empty(wc.shape(), dy.dtype(), dy.device());
      cuda::grouped_linear_backward_dev(dx, dw, dy.contiguous(), xc, wc, offsets);
      return Grads{dx, dw};
    });
  }
  // The offsets on the host: free on the CPU, a wait on a GPU when they are there.
  Tensor host = offsets.to(kCpu);
  const int64_t* o = host.data<int64_t>();
  std::vector<int64_t> counts(static_cast<size_t>(E));
  MT_CHECK(o[0] == 0 && o[E] <= M, "grouped_linear: offsets run from {} to {} for x {}", o[0], o[E], x.shape());
  for (int64_t e = 0; e < E; ++e) {
    MT_CHECK(o[e + 1] >= o[e], "grouped_linear: offsets decrease at expert {} ({} -> {})", e, o[e], o[e + 1]);
    counts[static_cast<size_t>(e)] = o[e + 1] - o[e];
  }
  if (o[E] == M) return grouped_linear(x, w, counts);
  const Tensor kept = grouped_linear(slice(x, 0, 0, o[E]), w, counts);
  return concat({kept, zeros({M - o[E], w.size(1)}, kept.dtype(), kept.device())}, 0);
}

Tensor moe_combine(const Tensor& rows, const ExpertRows& plan, const Tensor& weights) {
  check_float("moe_combine", "rows", rows);
  check_rank("moe_combine", "rows", rows, 2);
  check_rank("moe_combine", "weights", weights, 2);
  MT_CHECK(plan.slot_row.numel() == weights.numel() && rows.size(0) == plan.row_token.numel() &&
               plan.slot_row.device() == rows.device(),
           "moe_combine: rows {} and weights {} for a plan of {} rows on {}", rows.shape(), weights.shape(),
           plan.row_token.numel(), plan.slot_row.device());
  return combine_rows(rows, plan.slot_row, weights, !plan.may_drop);
}

}  // namespace moetrain
