// Activation recomputation of the hybrid model (train.activation_checkpointing,
// docs/training.md#activation-recomputation): each layer call runs again in backward
// under checkpoint(); the loss, every gradient and the MoE statistics equal those of
// the run that stores the activations, bit for bit (the same ops in the same order,
// and the gradients of a layer's reads summed inside the layer in both runs).
#include <catch2/catch.hpp>

#include "fixtures.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::random_ids;
using moetrain::testing::tiny_hybrid;

namespace {

struct RecomputeRun {
  Tensor loss;
  Tensors grads;
  std::vector<std::vector<double>> tokens_per_expert;
  std::vector<int64_t> dropped;
};

// What is recomputed: whole layers and/or the modules of train.recompute_modules.
struct Recompute {
  bool layers = false, act = false, experts = false;
};

// Two micro-batches' gradients accumulated (as the trainer does), then the statistics.
RecomputeRun recompute_run(HybridConfig c, Recompute r) {
  c.recompute = r.layers;
  c.ffn.recompute_act = r.act;
  c.moe.recompute_experts = r.experts;
  HybridModel model(c, 17);
  RecomputeRun run;
  for (uint64_t micro = 0; micro < 2; ++micro) {
    Tensor l = model.loss(random_ids(2, 9, c.vocab_size, 3 + micro), random_ids(2, 9, c.vocab_size, 7 + micro));
    l.backward();
    run.loss = run.loss.defined() ? add(run.loss, l.detach()) : l.detach();
  }
  for (NamedParameter& p : model.parameters()) run.grads.push_back(p.tensor.grad());
  for (MoeLayer* m : model.moe_layers()) {
    run.tokens_per_expert.push_back(m->stats().tokens_per_expert);
    run.dropped.push_back(m->stats().dropped);
  }
  return run;
}

void check_same(const RecomputeRun& stored, const RecomputeRun& again, const HybridModel& names) {
  CHECK(moetrain::testing::bitwise_equal(stored.loss, again.loss));
  REQUIRE(stored.grads.size() == again.grads.size());
  const ParameterList& params = const_cast<HybridModel&>(names).parameters();
  for (size_t i = 0; i < stored.grads.size(); ++i) {
    INFO(params[i].name);
    REQUIRE(stored.grads[i].defined() == again.grads[i].defined());
    if (stored.grads[i].defined()) CHECK(moetrain::testing::bitwise_equal(stored.grads[i], again.grads[i]));
  }
  CHECK(stored.tokens_per_expert == again.tokens_per_expert);  // counted once per micro-batch, not again in backward
  CHECK(stored.dropped == again.dropped);
}

}  // namespace

TEST_CASE("hybrid recompute: loss, gradients and MoE statistics equal the stored run bit for bit",
          "[nn][hybrid][recompute]") {
  for (DType dtype : {DType::f32, DType::f64}) {
    for (bool attn_res : {true, false}) {
      for (bool with_aux : {false, true}) {
        DYNAMIC_SECTION(dtype_name(dtype) << (attn_res ? " attn_res" : " plain residual")
                                          << (with_aux ? " aux+z loss, capacity" : " dropless")) {
          HybridConfig c = tiny_hybrid(dtype, attn_res);
          if (with_aux) {
            c.moe.aux_loss_weight = 0.1;  // the aux loss's gradient reaches the router through recomputation
            c.moe.z_loss_weight = 0.01;
            c.moe.capacity_factor = 1.0;  // drops: counted once
          }
          const RecomputeRun stored = recompute_run(c, {});
          HybridModel names(c, 17);
          // Whole layers, each selective module, both, and both inside recomputed layers.
          for (Recompute r : {Recompute{true, false, false}, Recompute{false, true, false},
                              Recompute{false, false, true}, Recompute{false, true, true},
                              Recompute{true, true, true}}) {
            INFO("layers " << r.layers << " act " << r.act << " experts " << r.experts);
            check_same(stored, recompute_run(c, r), names);
          }
          // The statistics are real counts: every assignment of both micro-batches (2 x 2 x 9 tokens, top 2).
          double assigned = 0;
          for (size_t i = 0; i < stored.tokens_per_expert.size(); ++i) {
            for (double n : stored.tokens_per_expert[i]) assigned += n;
            assigned += static_cast<double>(stored.dropped[i]);
          }
          CHECK(assigned == static_cast<double>(stored.tokens_per_expert.size() * 2 * 2 * 9 * 2));
        }
      }
    }
  }
}

TEST_CASE("hybrid recompute: the aux loss is in the loss and its gradient reaches the router",
          "[nn][hybrid][recompute]") {
  // Without the aux loss the router gradient differs: the recomputed run does not drop it.
  HybridConfig c = tiny_hybrid(DType::f64);
  c.moe.aux_loss_weight = 0.5;
  const RecomputeRun with = recompute_run(c, {true, false, false});
  c.moe.aux_loss_weight = 0.0;
  const RecomputeRun without = recompute_run(c, {true, false, false});
  CHECK(with.loss.item<double>() > without.loss.item<double>());
  HybridModel names(c, 17);
  bool router_differs = false;
  const ParameterList& params = names.parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].name.find("mlp.gate.weight") != std::string::npos)
      router_differs = router_differs || !moetrain::testing::bitwise_equal(with.grads[i], without.grads[i]);
  CHECK(router_differs);
}

TEST_CASE("hybrid recompute: evaluation and decoding run without checkpoints and give the same logits",
          "[nn][hybrid][recompute]") {
  HybridConfig c = tiny_hybrid(DType::f64);
  HybridModel stored(c, 5);
  c.recompute = true;
  c.ffn.recompute_act = true;
  c.moe.recompute_experts = true;
  HybridModel again(c, 5);
  const Tensor ids = random_ids(1, 6, c.vocab_size, 2);
  CHECK(moetrain::testing::bitwise_equal(stored.forward(ids, false), again.forward(ids, false)));
  std::unique_ptr<DecodeCache> a = stored.new_cache(), b = again.new_cache();
  CHECK(moetrain::testing::bitwise_equal(stored.forward_cached(ids, *a), again.forward_cached(ids, *b)));
}

TEST_CASE("hybrid recompute: the ledger's activations shrink by what each module no longer keeps",
          "[nn][hybrid][recompute]") {
  // Per token and layer (f64, no head): act keeps 2 of the 3 F-wide hidden tensors of
  // the dense FFN, the shared experts and each routed slot; experts none of the routed slots'.
  HybridConfig c = tiny_hybrid(DType::f64);
  const double F = static_cast<double>(c.ffn.d_ff), Fe = static_cast<double>(c.moe.expert_d_ff);
  const double k = static_cast<double>(c.moe.top_k), shared = static_cast<double>(c.moe.num_shared_experts);
  auto bytes = [&](bool act, bool experts, int64_t layer) {
    HybridConfig x = c;
    x.ffn.recompute_act = act;
    x.moe.recompute_experts = experts;
    return HybridModel(x, 1, false).activation_bytes_per_token(false, layer, layer + 1, false);
  };
  const int64_t dense = 0, moe = 3;  // tiny_hybrid: MoE from layer 2
  CHECK(bytes(false, false, dense) - bytes(true, false, dense) == Approx(8.0 * F));
  CHECK(bytes(false, false, moe) - bytes(true, false, moe) == Approx(8.0 * (k * Fe + shared * Fe)));
  CHECK(bytes(false, false, moe) - bytes(false, true, moe) == Approx(8.0 * 3.0 * k * Fe));
  CHECK(bytes(false, false, moe) - bytes(true, true, moe) == Approx(8.0 * (3.0 * k * Fe + shared * Fe)));
}

TEST_CASE("hybrid recompute: the selective modules' extra forward FLOPs the ledger charges",
          "[nn][hybrid][recompute]") {
  // tiny_hybrid: D 12, dense FFN F 10 in layers 0-1; latent MoE in layers 2-4 (W 4, E 4,
  // top 2, F_e 3, one shared expert of width F_e on D). 2 FLOPs per weight element a token meets.
  HybridConfig c = tiny_hybrid(DType::f64);
  const double D = 12, F = 10, W = 4, Fe = 3, k = 2;
  auto flops = [&](bool act, bool experts) {
    HybridConfig x = c;
    x.ffn.recompute_act = act;
    x.moe.recompute_experts = experts;
    return HybridModel(x, 1, false).selective_recompute_flops_per_token(0, x.n_layer());
  };
  const double dense_down = 2 * 2 * D * F, shared_down = 3 * 2 * D * Fe;
  CHECK(flops(false, false) == 0.0);
  CHECK(flops(true, false) == Approx(dense_down + shared_down + 3 * 2 * k * W * Fe));    // down-projections
  CHECK(flops(false, true) == Approx(3 * 2 * k * 3 * W * Fe));                          // w1, w3, w2 per slot
  CHECK(flops(true, true) == Approx(dense_down + shared_down + 3 * 2 * k * 3 * W * Fe));
}
