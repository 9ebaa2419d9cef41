// The optimizer seam (src/optim/optimizer.h, make_optimizer.h): the chained
// optimizer of train.optimizer muon against its rules applied one by one; the
// split of parameters between Muon and AdamW; Muon sharded by whole matrices
// (train.zero 1) against the unsharded rule, bit for bit; the cut of a zero group
// at whole units (comm::make_flat_shards with units); Muon's finite-update check
// against the update it predicts.
#include <catch2/catch.hpp>

#include <limits>
#include <string>
#include <vector>

#include "comm/grad_sync.h"
#include "moetrain.h"
#include "optim/make_optimizer.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using std::string;

namespace {

// A small model-like list: an embedding, a hidden matrix, an expert batch, a norm
// vector, a router gate and a conv weight.
ParameterList mixed_list(DType dtype, uint64_t seed) {
  struct Spec {
    const char* name;
    Shape shape;
    const char* group;
    bool decay;
  };
  const std::vector<Spec> specs{{"embed.weight", {11, 6}, "embedding", false},
                                {"layers.0.q_proj.weight", {8, 6}, "attention", true},
                                {"layers.0.experts.w1", {3, 5, 6}, "experts", true},
                                {"layers.0.norm.weight", {6}, "norm", false},
                                {"layers.0.gate.weight", {3, 6}, "router", true},
                                {"layers.0.q_conv1d.weight", {6, 4}, "kda", false},
                                {"layers.0.o_proj.weight", {6, 9}, "attention", true}};
  ParameterList out;
  for (size_t i = 0; i < specs.size(); ++i) {
    Tensor t = mul_scalar(randn(specs[i].shape, DType::f64, seed + i), 0.5).to(dtype);
    t.set_requires_grad(true);
    out.push_back({specs[i].name, t, specs[i].decay, specs[i].group});
  }
  return out;
}

void set_grads(ParameterList& ps, uint64_t seed) {
  for (size_t i = 0; i < ps.size(); ++i)
    ps[i].tensor.set_grad(randn(ps[i].tensor.shape(), DType::f64, seed + 31 * i).to(ps[i].tensor.dtype()));
}

OptimizerOptions muon_options() {
  OptimizerOptions o;
  o.kind = "muon";
  o.adamw = {0.9, 0.95, 1e-8, 0.1};
  o.muon.weight_decay = 0.1;
  return o;
}

}  // namespace

TEST_CASE("optimizer: train.optimizer muon gives the hidden matrices to Muon and the rest to AdamW",
          "[optim][muon]") {
  const ParameterList ps = mixed_list(DType::f32, 1);
  const OptimizerOptions o = muon_options();
  std::vector<string> muon;
  for (const NamedParameter& p : ps)
    if (uses_muon(o, p)) muon.push_back(p.name);
  CHECK(muon == std::vector<string>{"layers.0.q_proj.weight", "layers.0.experts.w1", "layers.0.o_proj.weight"});
  OptimizerOptions adamw = o;
  adamw.kind = "adamw";
  for (const NamedParameter& p : ps) CHECK(!uses_muon(adamw, p));
  // The cost: AdamW elements count 1; a Muon matrix adds its Newton-Schulz flops / 10.
  CHECK(update_cost(o, ps[0]) == 66);
  CHECK(update_cost(o, ps[1]) == Approx(48 + 5 * (4.0 * 36 * 8 + 2.0 * 216) / 10));
  CHECK(update_cost(o, ps[2]) == Approx(90 + 3 * 5 * (4.0 * 25 * 6 + 2.0 * 125) / 10));
}

TEST_CASE("optimizer: the chained optimizer equals AdamW and Muon applied to their own parameters, bit for bit; "
          "its slots are each rule's", "[optim][muon]") {
  const OptimizerOptions o = muon_options();
  ParameterList chained = mixed_list(DType::f64, 7), split = mixed_list(DType::f64, 7);
  const std::unique_ptr<Optimizer> opt = make_optimizer(chained, o);
  ParameterList adam_part, muon_part;
  for (const NamedParameter& p : split) (uses_muon(o, p) ? muon_part : adam_part).push_back(p);
  AdamW adamw(adam_part, o.adamw);
  Muon muon(muon_part, o.muon);
  CHECK(opt->slot_names() == std::vector<string>{"exp_avg", "exp_avg_sq", "momentum"});
  CHECK(opt->state_bytes() == adamw.state_bytes() + muon.state_bytes());
  for (int step = 0; step < 3; ++step) {
    set_grads(chained, 100 + step);
    set_grads(split, 100 + step);
    CHECK(!opt->non_finite_update(0.02));
    opt->step(0.02);
    adamw.step(0.02);
    muon.step(0.02);
  }
  CHECK(opt->steps() == 3);
  for (size_t i = 0; i < chained.size(); ++i) {
    INFO(chained[i].name);
    CHECK(bitwise_equal(chained[i].tensor.detach(), split[i].tensor.detach()));
    const bool m = uses_muon(o, chained[i]);
    CHECK(opt->has_slot("momentum", i) == m);
    CHECK(opt->has_slot("exp_avg", i) == !m);
    CHECK(opt->slot("exp_avg_sq", i).defined() == !m);
    if (m) CHECK(bitwise_equal(opt->slot("momentum", i), muon.momentum(chained[i].name)));
  }
  opt->set_steps(9);
  CHECK(opt->steps() == 9);
}

TEST_CASE("optimizer: make_flat_shards with units cuts only between units and balances the cost", "[optim][comm]") {
  // p0: 10 elements cut anywhere; p1: a batch of 4 matrices of 6; p2: one matrix of 20.
  const std::vector<int64_t> numels{10, 24, 20}, units{1, 6, 20};
  const std::vector<double> costs{10, 24, 20};
  for (int size : {1, 2, 3, 4, 7}) {
    const comm::FlatShards s = comm::make_flat_shards(numels, size, units, costs);
    REQUIRE(s.size() == size);
    CHECK(s.bounds.front() == 0);
    CHECK(s.bounds.back() == 54);
    for (int r = 0; r < size; ++r) {
      CHECK(s.bounds[r] <= s.bounds[r + 1]);
      const int64_t b = s.bounds[r];
      // A cut inside p1 lies between matrices, never inside p2.
      if (b > 10 && b < 34) CHECK((b - 10) % 6 == 0);
      CHECK(!(b > 34 && b < 54));
    }
  }
  // Hand-worked, 2 ranks: the half of the cost (27) falls in p1 at element 17 of it,
  // between matrices 12 and 18: the nearer is 18 (1 away against 5): cut at 28.
  CHECK(comm::make_flat_shards(numels, 2, units, costs).bounds == std::vector<int64_t>{0, 28, 54});
  // A costly p2 pulls the cut forward: costs 10 + 24 + 66 = 100, half = 50 falls in
  // p2 at 16/66 of it; p2 is whole, so the nearer end: its start (34).
  CHECK(comm::make_flat_shards(numels, 2, units, {10, 24, 66}).bounds == std::vector<int64_t>{0, 34, 54});
  // Units of 1 and cost = elements: the equal split (ties to the earlier cut).
  CHECK(comm::make_flat_shards(numels, 2, {1, 1, 1}, costs).bounds == std::vector<int64_t>{0, 27, 54});
}

TEST_CASE("optimizer: Muon and AdamW sharded over 3 simulated ranks (whole matrices for Muon) equal the unsharded "
          "optimizer bit for bit", "[optim][muon]") {
  const OptimizerOptions o = muon_options();
  for (DType dtype : {DType::f64, DType::f32}) {
    INFO(fmt::format("{}", dtype));
    constexpr int kRanks = 3;
    ParameterList whole = mixed_list(dtype, 3);
    std::vector<ParameterList> ranks;
    for (int r = 0; r < kRanks; ++r) ranks.push_back(mixed_list(dtype, 3));
    std::vector<int64_t> numels, units;
    std::vector<double> costs;
    for (const NamedParameter& p : whole) {
      numels.push_back(p.tensor.numel());
      units.push_back(uses_muon(o, p) ? p.tensor.size(-2) * p.tensor.size(-1) : 1);
      costs.push_back(update_cost(o, p));
    }
    const comm::FlatShards shards = comm::make_flat_shards(numels, kRanks, units, costs);
    const std::unique_ptr<Optimizer> ref = make_optimizer(whole, o);
    std::vector<std::unique_ptr<Optimizer>> opts;
    for (int r = 0; r < kRanks; ++r) {
      std::vector<ElementRange> own;
      for (size_t i = 0; i < whole.size(); ++i) {
        const auto [a, b] = shards.owned(i, r);
        own.push_back({a, b});
      }
      opts.push_back(make_optimizer(ranks[r], o, own));
    }
    int64_t sharded_bytes = 0;
    for (const auto& opt : opts) sharded_bytes += opt->state_bytes();
    CHECK(sharded_bytes == ref->state_bytes());
    for (int step = 0; step < 3; ++step) {
      set_grads(whole, 50 + step);
      for (ParameterList& ps : ranks) set_grads(ps, 50 + step);
      ref->step(0.03);
      for (auto& opt : opts) opt->step(0.03);
      // The all-gather: every copy takes each owner's elements.
      for (int from = 0; from < kRanks; ++from)
        for (int to = 0; to < kRanks; ++to)
          if (from != to)
            for (size_t i = 0; i < whole.size(); ++i)
              copy_(opts[from]->owned_part(i, ranks[to][i].tensor.detach()),
                    opts[from]->owned_part(i, ranks[from][i].tensor.detach()));
    }
    for (size_t i = 0; i < whole.size(); ++i) {
      INFO(whole[i].name);
      for (int r = 0; r < kRanks; ++r) CHECK(bitwise_equal(ranks[r][i].tensor.detach(), whole[i].tensor.detach()));
      if (!uses_muon(o, whole[i])) continue;
      // Each owned matrix's momentum is the unsharded one's rows.
      for (int r = 0; r < kRanks; ++r) {
        const ElementRange own = opts[r]->owned(i);
        const Tensor m = opts[r]->slot("momentum", i);
        CHECK(m.defined() == (own.size() > 0));
        if (own.size() > 0)
          CHECK(bitwise_equal(reshape(m, {own.size()}),
                              alias(ref->slot("momentum", i), Shape{own.size()}, own.begin)));
      }
    }
  }
}

TEST_CASE("optimizer: Muon refuses a range that splits a matrix", "[optim][muon]") {
  ParameterList ps = mixed_list(DType::f32, 5);
  ParameterList muon{ps[2]};  // [3, 5, 6]: matrices of 30 elements
  CHECK_THROWS_WITH(Muon(muon, {}, {{0, 45}}), Catch::Contains("layers.0.experts.w1") &&
                                                   Catch::Contains("whole matrices of 30 elements"));
  Muon ok(muon, {}, {{30, 90}});  // matrices 1 and 2
  CHECK(ok.slot("momentum", 0).shape() == Shape{2, 5, 6});
  Muon none(muon, {}, {{0, 0}});
  CHECK(!none.slot("momentum", 0).defined());
  CHECK(none.has_slot("momentum", 0));
}

TEST_CASE("optimizer: Muon's finite-update check agrees with the update it checks", "[optim][muon]") {
  MuonOptions o;
  auto make = [](const std::vector<double>& w) {
    Tensor t = from_vector(w, {2, 3}, DType::f32);
    t.set_requires_grad(true);
    return ParameterList{{"w", t, true, "mlp"}};
  };
  const std::vector<double> g{0.5, -1, 0.25, 2, -0.5, 1};
  SECTION("healthy values: nothing") {
    ParameterList ps = make({1, 2, 3, 4, 5, 6});
    Muon m(ps, o);
    ps[0].tensor.set_grad(from_vector(g, {2, 3}, DType::f32));
    CHECK(!m.non_finite_update(0.02));
  }
  SECTION("a NaN gradient element is named") {
    ParameterList ps = make({1, 2, 3, 4, 5, 6});
    Muon m(ps, o);
    std::vector<double> bad = g;
    bad[4] = std::nan("");
    ps[0].tensor.set_grad(from_vector(bad, {2, 3}, DType::f32));
    const std::optional<NonFiniteTensor> r = m.non_finite_update(0.02);
    REQUIRE(r);
    CHECK(r->name == "w");
  }
  SECTION("weights at the edge of f32: the check predicts exactly what the step makes") {
    const double big = 3.4e38;
    for (double lr : {1e-30, 1e36}) {
      INFO("lr " << lr);
      ParameterList ps = make({big, -big, 1, big, 2, -3});
      Muon m(ps, o);
      ps[0].tensor.set_grad(from_vector(g, {2, 3}, DType::f32));
      const std::optional<NonFiniteTensor> predicted = m.non_finite_update(lr);
      m.step(lr);
      const int64_t made = count_non_finite(ps[0].tensor.detach());
      CHECK((predicted ? predicted->count : 0) == made);
    }
  }
}
