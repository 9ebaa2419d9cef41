// The expert plan where the ids are (ops/moe/moe.h: plan_expert_rows, moe_gather,
// grouped_linear on offsets, moe_combine on the plan) against the host plan of
// nn/moe.h (plan_experts) and the ops it replaces; a local MoE layer through it
// against the same layer through the host plan and the dispatcher.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <random>

#include "moetrain.h"
#include "nn/moe.h"
#include "ops/cuda_vs_cpu.h"
#include "ops/moe/moe.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

namespace {

std::vector<int64_t> host_i64(const Tensor& t) {
  const Tensor h = t.to(kCpu);
  return std::vector<int64_t>(h.data<int64_t>(), h.data<int64_t>() + h.numel());
}

// N·k ids, each row k distinct experts (as the router picks them), skewed toward
// the low ids when `skew` so that a capacity drops some.
Tensor random_ids(int64_t N, int64_t k, int64_t E, uint64_t seed, bool skew) {
  std::mt19937_64 gen(seed);
  Tensor ids = empty({N, k}, DType::i64);
  int64_t* p = ids.data<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int64_t> pool(static_cast<size_t>(E));
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t s = 0; s < k; ++s) {
      const uint64_t r = gen();
      const int64_t left = E - s;
      const int64_t j = skew ? static_cast<int64_t>(r % static_cast<uint64_t>(std::min<int64_t>(left, 3)))
                             : static_cast<int64_t>(r % static_cast<uint64_t>(left));
      p[n * k + s] = pool[static_cast<size_t>(j)];
      pool.erase(pool.begin() + j);
    }
  }
  return ids;
}

struct PlanCase {
  int64_t N, k, E, capacity;
  bool skew;
};

const std::vector<PlanCase> kPlanCases = {
    {10, 2, 6, 0, false}, {10, 2, 6, 3, true},   {37, 4, 16, 0, true},  {37, 4, 16, 7, true},
    {64, 8, 64, 0, false}, {64, 8, 64, 9, false}, {5, 1, 1, 0, false},   {5, 1, 1, 2, false},
    {1, 3, 3, 0, false},   {0, 2, 4, 0, false},   {200, 16, 896, 0, false}};

}  // namespace

TEST_CASE("plan_expert_rows: plan_experts' order, counts and drops, every shape fixed at N·k rows", "[ops][moe]") {
  uint64_t seed = 1;
  for (const PlanCase& c : kPlanCases) {
    INFO("N " << c.N << " k " << c.k << " E " << c.E << " capacity " << c.capacity);
    const Tensor ids = random_ids(c.N, c.k, c.E, seed++, c.skew);
    const std::vector<int64_t> flat = host_i64(ids);
    const ExpertPlan ref = plan_experts(flat, c.E, c.capacity);
    const ExpertRows plan = plan_expert_rows(ids, c.E, c.capacity);
    const int64_t A = c.N * c.k, kept = static_cast<int64_t>(ref.order.size());
    const std::vector<int64_t> counts = host_i64(plan.counts), offsets = host_i64(plan.offsets),
                               token = host_i64(plan.row_token), slot = host_i64(plan.slot_row);
    REQUIRE(counts.size() == static_cast<size_t>(c.E + 1));
    REQUIRE(token.size() == static_cast<size_t>(A));
    CHECK(std::vector<int64_t>(counts.begin(), counts.end() - 1) == ref.counts);
    CHECK(counts.back() == ref.dropped);
    CHECK(offsets.front() == 0);
    for (int64_t e = 0; e < c.E; ++e) CHECK(offsets[e + 1] - offsets[e] == ref.counts[e]);
    CHECK(offsets.back() == kept);
    CHECK(plan.may_drop == (c.capacity > 0));
    std::vector<int64_t> want_slot(static_cast<size_t>(A), A);
    for (int64_t i = 0; i < kept; ++i) {
      CHECK(token[i] == ref.order[i] / c.k);
      want_slot[ref.order[i]] = i;
    }
    for (int64_t i = kept; i < A; ++i) CHECK(token[i] == 0);  // padding
    CHECK(slot == want_slot);
    if (c.capacity == 0) CHECK(kept == A);
    if (c.capacity > 0 && c.skew) CHECK(ref.dropped > 0);  // the case drops something
  }
}

TEST_CASE("plan_expert_rows: bad ids and shapes are named", "[ops][moe]") {
  Tensor ids = random_ids(4, 2, 5, 3, false);
  ids.data<int64_t>()[5] = 5;
  CHECK_THROWS_WITH(plan_expert_rows(ids, 5), Catch::Contains("expert id 5 at 5 outside [0, 5)"));
  ids.data<int64_t>()[5] = -1;
  CHECK_THROWS_WITH(plan_expert_rows(ids, 5), Catch::Contains("expert id -1 at 5"));
  CHECK_THROWS_WITH(plan_expert_rows(random_ids(4, 2, 5, 3, false).to(DType::i32), 5),
                    Catch::Contains("must be i64 [N, k]"));
  CHECK_THROWS_WITH(plan_expert_rows(empty({2, 65}, DType::i64), 100), Catch::Contains("top_k 65 must be in [1, 64]"));
}

TEST_CASE("moe_gather: the tokens' rows; its gradient is index_select's, bit for bit, and finite differences agree",
          "[ops][moe]") {
  for (int64_t capacity : {int64_t{0}, int64_t{4}}) {
    INFO("capacity " << capacity);
    const int64_t N = 13, k = 3, E = 5, W = 7;
    const ExpertRows plan = plan_expert_rows(random_ids(N, k, E, 11, true), E, capacity);
    const int64_t kept = host_i64(plan.offsets).back();
    const std::vector<int64_t> token = host_i64(plan.row_token);
    const std::vector<int64_t> kept_token(token.begin(), token.begin() + kept);
    if (capacity > 0) REQUIRE(kept < N * k);
    for (DType dt : {DType::f32, DType::f64, DType::bf16}) {  // bf16: its own kernels, the widened path's bits
      INFO("dtype " << dtype_name(dt));
      Tensor z = randn({N, W}, DType::f32, 12).to(dt);
      // Padding rows' gradients are not the gather's to carry (the experts give them zero).
      Tensor dy = concat({randn({kept, W}, DType::f32, 13).to(dt), zeros({N * k - kept, W}, dt)}, 0);
      Tensor za = z.clone().set_requires_grad(), zb = z.clone().set_requires_grad();
      Tensor rows = moe_gather(za, plan);
      Tensor ref = index_select(zb, 0, kept_token);
      CHECK(testing::bitwise_equal(slice(rows, 0, 0, kept), ref));
      autograd::backward({rows}, {dy});
      autograd::backward({ref}, {slice(dy, 0, 0, kept).contiguous()});
      CHECK(testing::bitwise_equal(za.grad(), zb.grad()));
    }
    check_gradients([&](const Tensors& in) { return slice(moe_gather(in[0], plan), 0, 0, kept); },
                    {randn({N, W}, DType::f64, 14)});
  }
}

TEST_CASE("grouped_linear on offsets: the counts' products on the kept rows, zeros on the padding", "[ops][moe]") {
  const int64_t in = 6, out = 5, E = 4;
  // Experts 1 and 3 without rows; 3 padding rows after the 9 kept ones.
  const std::vector<int64_t> counts = {3, 0, 6, 0}, offs = {0, 3, 3, 9, 9};
  for (int64_t M : {int64_t{9}, int64_t{12}}) {
    INFO("rows " << M);
    const Tensor offsets = from_span<int64_t>(offs, {E + 1});
    for (DType dt : {DType::f32, DType::f64}) {
      Tensor x = randn({M, in}, dt, 1), w = randn({E, out, in}, dt, 2), dy = randn({M, out}, dt, 3);
      Tensor xa = x.clone().set_requires_grad(), wa = w.clone().set_requires_grad();
      Tensor xb = slice(x, 0, 0, 9).contiguous().set_requires_grad(), wb = w.clone().set_requires_grad();
      Tensor ya = grouped_linear(xa, wa, offsets), yb = grouped_linear(xb, wb, counts);
      REQUIRE(ya.shape() == Shape{M, out});
      CHECK(testing::bitwise_equal(slice(ya, 0, 0, 9), yb));
      for (double v : slice(ya, 0, 9, M).to_vector()) CHECK(v == 0.0);
      autograd::backward({ya}, {dy});
      autograd::backward({yb}, {slice(dy, 0, 0, 9).contiguous()});
      CHECK(testing::bitwise_equal(slice(xa.grad(), 0, 0, 9), xb.grad()));
      for (double v : slice(xa.grad(), 0, 9, M).to_vector()) CHECK(v == 0.0);
      CHECK(testing::bitwise_equal(wa.grad(), wb.grad()));
    }
    check_gradients([&](const Tensors& t) { return grouped_linear(t[0], t[1], offsets); },
                    {randn({M, in}, DType::f64, 4), randn({E, out, in}, DType::f64, 5)});
  }
  Tensor x = randn({9, in}, DType::f64, 6), w = randn({E, out, in}, DType::f64, 7);
  const std::vector<int64_t> short_offsets = {0, 3, 9}, decreasing = {0, 3, 2, 9, 9}, past = {0, 3, 3, 9, 10};
  CHECK_THROWS_WITH(grouped_linear(x, w, from_span<int64_t>(short_offsets, {3})), Catch::Contains("must be i64 [5]"));
  CHECK_THROWS_WITH(grouped_linear(x, w, from_span<int64_t>(decreasing, {5})),
                    Catch::Contains("offsets decrease at expert 1"));
  CHECK_THROWS_WITH(grouped_linear(x, w, from_span<int64_t>(past, {5})),
                    Catch::Contains("offsets run from 0 to 10 for x [9, 6]"));
}

TEST_CASE("moe_combine on the plan equals moe_combine on the slot-row list, dropped slots included", "[ops][moe]") {
  for (int64_t capacity : {int64_t{0}, int64_t{3}}) {
    INFO("capacity " << capacity);
    const int64_t N = 11, k = 2, E = 6, W = 5;
    const ExpertRows plan = plan_expert_rows(random_ids(N, k, E, 21, true), E, capacity);
    Tensor rows = randn({N * k, W}, DType::f64, 22), weights = randn({N, k}, DType::f64, 23);
    Tensor ra = rows.clone().set_requires_grad(), wa = weights.clone().set_requires_grad();
    Tensor rb = rows.clone().set_requires_grad(), wb = weights.clone().set_requires_grad();
    Tensor ya = moe_combine(ra, plan, wa), yb = moe_combine(rb, host_i64(plan.slot_row), wb);
    CHECK(testing::bitwise_equal(ya, yb));
    sum(square(ya)).backward();
    sum(square(yb)).backward();
    CHECK(testing::bitwise_equal(ra.grad(), rb.grad()));  // padding rows: zero in both
    CHECK(testing::bitwise_equal(wa.grad(), wb.grad()));
  }
}

TEST_CASE("moe: a local layer planned where the ids are equals the host plan and dispatcher, statistics included",
          "[ops][moe]") {
  struct Case {
    int64_t latent;
    double capacity_factor;
    bool recompute;
  };
  for (const Case& cs : {Case{0, 0.0, false}, Case{3, 0.0, true}, Case{3, 0.8, false}, Case{0, 0.5, true}}) {
    INFO("latent " << cs.latent << " capacity factor " << cs.capacity_factor << " recompute " << cs.recompute);
    MoeConfig c;
    c.num_experts = 6;
    c.top_k = 2;
    c.num_shared_experts = 1;
    c.expert_d_ff = 5;
    c.latent_dim = cs.latent;
    c.capacity_factor = cs.capacity_factor;
    c.recompute_experts = cs.recompute;
    c.z_loss_weight = 1e-3;  // read from the logits: the device plan keeps it
    FfnConfig ffn;
    ffn.kind = FfnKind::situ_glu;
    const int64_t B = 2, T = 7, D = 4;
    ParamFactory fa(true, DType::f64, 3), fb(true, DType::f64, 3);
    MoeLayer a(c, D, ffn, 0.5, fa, "mlp."), b(c, D, ffn, 0.5, fb, "mlp.");
    Tensor x = randn({B, T, D}, DType::f64, 4);
    Routing routing;
    Tensor xa = x.clone().set_requires_grad(), xb = x.clone().set_requires_grad();
    // recompute: the whole layer again in backward too (activation checkpointing).
    auto run = [&](MoeLayer& l, const Tensor& in, Routing* r) {
      if (!cs.recompute) return l.forward(in, true, r);
      return checkpoint([&l, r](const Tensors& t) { return Tensors{l.forward(t[0], true, r)}; }, {in})[0];
    };
    Tensor ya = run(a, xa, nullptr);   // device plan
    Tensor yb = run(b, xb, &routing);  // the ids asked for: host plan, dispatcher
    CHECK(testing::bitwise_equal(ya, yb));
    add(sum(square(ya)), a.aux_loss()).backward();
    add(sum(square(yb)), b.aux_loss()).backward();
    CHECK(testing::bitwise_equal(xa.grad(), xb.grad()));
    CHECK(testing::bitwise_equal(a.w1.grad(), b.w1.grad()));
    CHECK(testing::bitwise_equal(a.router.gate_weight.grad(), b.router.gate_weight.grad()));
    CHECK(a.stats().tokens_per_expert == b.stats().tokens_per_expert);
    CHECK(a.stats().dropped == b.stats().dropped);
    if (cs.capacity_factor > 0) CHECK(a.stats().dropped > 0);
    CHECK(std::accumulate(a.stats().tokens_per_expert.begin(), a.stats().tokens_per_expert.end(), 0.0) +
              static_cast<double>(a.stats().dropped) ==
          static_cast<double>(B * T * c.top_k));  // counted once, recomputation or not
    a.stats().reset();
    CHECK(a.stats().dropped == 0);
  }
}

TEST_CASE("index_counts: each row's occurrences of each value; bad indices named", "[ops][moe]") {
  const std::vector<int64_t> v = {2, 0, 2, 1, 3, 3};
  const Tensor counts = index_counts(from_span<int64_t>(v, {3, 2}), 4, DType::f64);
  REQUIRE(counts.shape() == Shape{3, 4});
  CHECK(counts.to_vector() == std::vector<double>{1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 2});
  const std::vector<int64_t> bad = {0, 4};
  CHECK_THROWS_WITH(index_counts(from_span<int64_t>(bad, {1, 2}), 4, DType::f32),
                    Catch::Contains("index 4 at position 1 of index [1, 2] is outside [0, 4)"));
}

TEST_CASE("moe: the sequence-wise aux loss counted where the ids are equals the host count's formula", "[ops][moe]") {
  MoeConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.expert_d_ff = 5;
  c.aux_loss_weight = 0.3;
  FfnConfig ffn;
  ffn.kind = FfnKind::situ_glu;
  const int64_t B = 3, T = 5, D = 4, E = 6, k = 2;
  ParamFactory f(true, DType::f64, 7);
  MoeLayer layer(c, D, ffn, 0.5, f, "mlp.");
  Tensor x = randn({B, T, D}, DType::f64, 8);
  Routing r;
  layer.forward(x, true, &r);
  // α / B Σ_b Σ_i f_bi P_bi, f_bi = E / (k T) · (sequence b's assignments to i), P_bi
  // the sequence's mean of the normalised scores; in double from the host ids.
  const std::vector<double> s = r.scores.to_vector();
  double want = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < E; ++i) {
      double fi = 0, Pi = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = b * T + t;
        for (int64_t j = 0; j < k; ++j) fi += r.experts[n * k + j] == i ? static_cast<double>(E) / (k * T) : 0.0;
        double row = 0;
        for (int64_t e = 0; e < E; ++e) row += s[n * E + e];
        Pi += s[n * E + i] / row / static_cast<double>(T);
      }
      want += fi * Pi;
    }
  want *= 0.3 / static_cast<double>(B);
  REQUIRE(layer.aux_loss().defined());
  CHECK(layer.aux_loss().item<double>() == Approx(want).epsilon(1e-12));
  layer.forward(x, true);  // the device plan: the same value
  CHECK(layer.aux_loss().item<double>() == Approx(want).epsilon(1e-12));
}

TEST_CASE("plan_expert_rows, moe_gather and grouped_linear on offsets: CUDA matches CPU", "[ops][moe][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  const Device gpu{DeviceKind::cuda, 0};
  uint64_t seed = 31;
  for (const PlanCase& c : kPlanCases) {
    INFO("N " << c.N << " k " << c.k << " E " << c.E << " capacity " << c.capacity);
    const Tensor ids = random_ids(c.N, c.k, c.E, seed++, c.skew);
    const ExpertRows cpu = plan_expert_rows(ids, c.E, c.capacity), dev = plan_expert_rows(ids.to(gpu), c.E, c.capacity);
    CHECK(host_i64(dev.counts) == host_i64(cpu.counts));
    CHECK(host_i64(dev.offsets) == host_i64(cpu.offsets));
    CHECK(host_i64(dev.row_token) == host_i64(cpu.row_token));
    CHECK(host_i64(dev.slot_row) == host_i64(cpu.slot_row));
  }
  const int64_t N = 40, k = 4, E = 16, W = 48, out = 32;
  const Tensor ids = random_ids(N, k, E, 41, true);
  for (int64_t capacity : {int64_t{0}, int64_t{8}}) {
    const ExpertRows cpu = plan_expert_rows(ids, E, capacity), dev = plan_expert_rows(ids.to(gpu), E, capacity);
    Tensor z = randn({N, W}, DType::f32, 42).set_requires_grad();
    Tensor w = randn({E, out, W}, DType::f32, 43).set_requires_grad();
    auto fn = [&](const Tensors& in) {
      const ExpertRows& p = in[0].is_cuda() ? dev : cpu;
      return Tensors{grouped_linear(moe_gather(in[0], p), in[1], p.offsets)};
    };
    for (DType dtype : {DType::f32, DType::f64, DType::bf16})
      moetrain::testing::check_cuda_matches_cpu(fn, {z, w}, {true, true}, dtype,
                                                moetrain::testing::tolerance_for(dtype));
  }
}
