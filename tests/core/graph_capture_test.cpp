// The CUDA graph capture seam (core/graph_capture.h) on the host: what refuses while
// a step is captured, and the replay hooks the layers register for the host state a
// replay must set again (the MoE layer's pending counts, QK-Clip's max logits). The
// capture itself needs a GPU (tests/cli/cuda_graph_cli_test.cpp).
#include <catch2/catch.hpp>

#include <memory>
#include <numeric>
#include <vector>

#include "core/graph_capture.h"
#include "moetrain.h"
#include "nn/language_model.h"
#include "nn/mla.h"
#include "nn/moe.h"
#include "ops/dropout/dropout.h"
#include "testing.h"

using namespace moetrain;

TEST_CASE("graph capture: refusals only while capturing, hooks kept in order and handed over once",
          "[core][cuda_graph]") {
  CHECK_FALSE(graph::capturing());
  graph::refuse_if_capturing("a copy");  // nothing outside a capture
  std::vector<int> ran;
  graph::after_replay([&] { ran.push_back(-1); });  // outside: dropped
  graph::ReplayHooks hooks;
  {
    graph::CaptureScope scope;
    CHECK(graph::capturing());
    CHECK_THROWS_AS(graph::refuse_if_capturing("a copy from the host to the GPU"), graph::CaptureRefused);
    CHECK_THROWS_WITH(graph::refuse_if_capturing("a copy from the host to the GPU"),
                      Catch::Contains("a copy from the host to the GPU") && Catch::Contains("CUDA graph"));
    auto owner = std::make_shared<int>(7);
    std::weak_ptr<int> watch = owner;
    graph::keep(owner);
    owner.reset();
    CHECK_FALSE(watch.expired());  // the graph keeps it
    graph::before_replay([&] { ran.push_back(0); });
    graph::after_replay([&] { ran.push_back(1); });
    graph::after_replay([&] { ran.push_back(2); });
    hooks = scope.take();
    CHECK(scope.take().after.empty());
  }
  CHECK_FALSE(graph::capturing());
  REQUIRE(hooks.before.size() == 1);
  REQUIRE(hooks.after.size() == 2);
  for (auto& f : hooks.before) f();
  for (auto& f : hooks.after) f();
  CHECK(ran == std::vector<int>{0, 1, 2});
  REQUIRE(hooks.kept.size() == 1);
  hooks = graph::ReplayHooks{};  // the graph gone: what it kept is released
}

TEST_CASE("graph capture: MLA's RoPE tables live as long as the graph that reads them", "[core][cuda_graph]") {
  Generator gen(2);
  const Tensor x = randn({1, 5, 2, 8}, DType::f32, gen, 0.0, 1.0);
  graph::ReplayHooks hooks;
  {
    graph::CaptureScope scope;
    rope(x, 0, 10000.0);
    hooks = scope.take();
  }
  REQUIRE(hooks.kept.size() == 2);  // cos and sin
  // Other positions evict the cached tables (decoding asks for one per token): the
  // graph's copies stay alive.
  std::weak_ptr<const void> cos_table = hooks.kept[0];
  for (int64_t first = 1; first <= 40; ++first) rope(x, first, 10000.0);
  CHECK(cos_table.use_count() == 1);  // only the graph holds it now
}

TEST_CASE("graph capture: dropout refuses (its offsets are host numbers); p = 0 draws nothing", "[core][cuda_graph]") {
  Generator gen(1);
  Tensor x = randn({4, 8}, DType::f32, gen, 0.0, 1.0);
  graph::CaptureScope scope;
  CHECK_THROWS_WITH(dropout(x, 0.1), Catch::Contains("dropout"));
  CHECK(dropout(x, 0.0).same_storage(x));
}

TEST_CASE("graph capture: the MoE layer and QK-Clip hand their device sums back after a replay",
          "[core][cuda_graph]") {
  MoeConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.num_shared_experts = 0;
  c.expert_d_ff = 4;
  ParamFactory f(true, DType::f32, 1);
  FfnConfig ffn;
  ffn.kind = FfnKind::situ_glu;
  MoeLayer layer(c, 8, ffn, 0.5, f, "mlp.");
  Generator gen(5);
  const Tensor x1 = randn({2, 5, 8}, DType::f32, gen, 0.0, 1.0), x2 = randn({2, 5, 8}, DType::f32, gen, 0.0, 1.0);
  QkClipSite site;
  site.n_head = 3;
  graph::ReplayHooks hooks;
  {
    graph::CaptureScope scope;
    // Two micro-batches, as a captured step with train.grad_accum 2 runs them.
    NoGradGuard no_grad;
    layer.forward(x1, true);
    layer.forward(x2, true);
    fold_max_logit(site, full({3}, 1.5, DType::f32));
    fold_max_logit(site, full({3}, 2.5, DType::f32));
    hooks = scope.take();
  }
  const Tensor max_logit = site.max_logit;
  // The step ends: the counts are read (stats() settles the pending sum) and cleared,
  // the logits reset.
  const std::vector<double> counts = layer.stats().tokens_per_expert;
  CHECK(std::accumulate(counts.begin(), counts.end(), 0.0) == 2 * 5 * 2 * 2);  // tokens x top_k, two batches
  layer.stats().reset();
  site.max_logit = Tensor();
  CHECK(layer.stats().tokens_per_expert == std::vector<double>(6, 0.0));
  // A replay writes the same tensors; the hooks hand them back, the two batches' sum
  // last (the first batch's alone would count half).
  for (auto& fn : hooks.after) fn();
  CHECK(layer.stats().tokens_per_expert == counts);
  REQUIRE(site.max_logit.defined());
  CHECK(site.max_logit.same_storage(max_logit));
  CHECK(site.max_logit.to(DType::f64).to_vector() == std::vector<double>{2.5, 2.5, 2.5});
}
