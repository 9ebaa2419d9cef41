// The ledger of pp x dp x ep layouts and the planner (nn/ledger.h). Expected values
// are derived here from the parameter specs, the config and the formulas of
// docs/parallelism.md#the-ledger-flags, never read back from the ledger itself.
#include <cmath>
#include <set>
#include <string>

#include <catch2/catch.hpp>

#include "config/config.h"
#include "nn/gpt2.h"
#include "nn/hybrid.h"
#include "nn/ledger.h"
#include "nn/parameters.h"
#include "nn/pipeline_stages.h"

using namespace moetrain;

namespace {

Config load(const std::string& name, const std::vector<std::string>& overrides = {}) {
  return Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + name + ".yaml", overrides);
}

std::vector<ParamSpec> specs_of(const Config& config) {
  if (config.get_string("model.arch") == "hybrid")
    return HybridModel(HybridConfig::from(config), 0, /*allocate=*/false).param_specs();
  return Gpt2(Gpt2Config::from(config), 0, /*allocate=*/false).param_specs();
}

// The layer in a parameter's name (model.layers.<l>. or h.<l>.), -1 for none.
int64_t layer_in_name(const std::string& name) {
  for (const std::string prefix : {"model.layers.", "h."})
    if (name.rfind(prefix, 0) == 0) return std::stoll(name.substr(prefix.size()));
  return -1;
}

bool is_embedding_table(const std::string& name) { return name == "model.embed_tokens.weight" || name == "wte.weight"; }
bool is_before_layers(const std::string& name) { return is_embedding_table(name) || name == "wpe.weight"; }

struct Case {
  const char* config;
  std::vector<std::string> overrides;
  int64_t ep;
  bool tied;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {"k3-small", {}, 2, false},                               // MoE, AttnRes, untied
      {"k3-tiny", {"model.tie_embeddings=true"}, 4, true},      // MoE, tied
      {"gpt2-small", {}, 1, true},                              // tied, wpe
      {"k3-tiny", {"model.attn_res=false"}, 2, false},          // the residual stream
  };
  return c;
}

}  // namespace

TEST_CASE("ledger: per-rank parameters of the stages add up to the model, plus the tied copy", "[nn][ledger]") {
  for (const Case& c : cases()) {
    const Config config = load(c.config, c.overrides);
    const std::vector<ParamSpec> specs = specs_of(config);
    const int64_t n_layer = config.get_int("model.n_layer");
    int64_t total = 0, table = 0;
    for (const ParamSpec& s : specs) {
      total += s.shape.numel();
      if (is_embedding_table(s.name)) table = s.shape.numel();
    }
    for (int64_t pp : {1, 2, 4}) {
      DYNAMIC_SECTION(c.config << " " << (c.overrides.empty() ? "" : c.overrides[0]) << " pp " << pp) {
        const Ledger l = make_ledger(config, LedgerLayout{2, c.ep, pp});
        REQUIRE(static_cast<int64_t>(l.stages.size()) == pp);
        int64_t sum = 0;
        for (int64_t s = 0; s < pp; ++s) {
          const StageLedger& st = l.stages[static_cast<size_t>(s)];
          const StageLayers layers = stage_layers(n_layer, pp, s);
          CHECK(st.first_layer == layers.first);
          CHECK(st.end_layer == layers.end);
          // This stage's parameters by their names: its layers; stage 0 the embeddings;
          // the last stage everything after the layers and, tied at pp > 1, the table again.
          int64_t expected = 0, experts = 0;
          for (const ParamSpec& p : specs) {
            const int64_t layer = layer_in_name(p.name);
            const bool here = layer >= 0 ? layer >= layers.first && layer < layers.end
                                         : is_before_layers(p.name) ? s == 0 : s == pp - 1;
            const bool copy = c.tied && pp > 1 && s == pp - 1 && is_embedding_table(p.name);
            if (!here && !copy) continue;
            const int64_t n = p.group == "experts" ? p.shape.numel() / c.ep : p.shape.numel();
            expected += n;
            if (p.group == "experts") experts += n;
          }
          CHECK(st.params == expected);
          CHECK(st.expert_params == experts);
          int64_t by_component = 0;
          for (const auto& [group, n] : st.components) by_component += n;
          CHECK(by_component == st.params);
          sum += (st.params - st.expert_params) + st.expert_params * c.ep;
        }
        CHECK(sum == total + (c.tied && pp > 1 ? table : 0));
      }
    }
  }
}

TEST_CASE("ledger: a stage's parameters are those the trainer's stage model allocates", "[nn][ledger]") {
  // The pipeline trainer builds HybridModel with a PipelineStage (docs/parallelism.md#pipeline-parallelism);
  // its allocated parameters on one rank of ep 2 are what the ledger places there.
  for (bool tied : {false, true}) {
    const Config config = load("k3-tiny", {tied ? "model.tie_embeddings=true" : "model.tie_embeddings=false"});
    const HybridConfig hc = HybridConfig::from(config);
    const HybridModel whole(hc, 0, /*allocate=*/false);
    for (int64_t pp : {2, 3, 4}) {
      const Ledger l = make_ledger(config, LedgerLayout{1, 2, pp});
      for (int64_t s = 0; s < pp; ++s) {
        INFO("tied " << tied << " pp " << pp << " stage " << s);
        HybridModel stage(hc, 0, /*allocate=*/true, ExpertShard{1, 2}, PipelineStage{s, pp});
        int64_t held = 0;
        for (const NamedParameter& p : stage.parameters()) held += p.tensor.numel();
        CHECK(l.stages[static_cast<size_t>(s)].params == held);
        // What the stage receives, D values per tensor.
        if (s > 0)
          CHECK(whole.boundary_values_per_token(stage_layers(hc.n_layer(), pp, s).first) ==
                stage.stage_input_count() * hc.d_model);
      }
    }
  }
}

TEST_CASE("ledger: zero 1 takes the sharded state off by 1 - 1/replicas", "[nn][ledger]") {
  for (const char* dtype : {"f32", "bf16"}) {
    const Config config = load("k3-small", {std::string("train.dtype=") + dtype});
    const bool bf16 = std::string(dtype) == "bf16";
    const std::vector<ParamSpec> specs = specs_of(config);
    const int64_t dp = 3, ep = 2, pp = 2, n_layer = config.get_int("model.n_layer");
    DYNAMIC_SECTION(dtype) {
      const Ledger z0 = make_ledger(config, LedgerLayout{dp, ep, pp, 0});
      const Ledger z1 = make_ledger(config, LedgerLayout{dp, ep, pp, 1});
      for (int64_t s = 0; s < pp; ++s) {
        const StageLayers layers = stage_layers(n_layer, pp, s);
        // Sharded per element: 2 f32 moments, and in bf16 runs the f32 master of
        // the parameters that become bf16 (docs/model.md#mixed-precision).
        double replicated = 0, expert = 0, full = 0;
        for (const ParamSpec& p : specs) {
          const int64_t layer = layer_in_name(p.name);
          const bool here = layer >= 0 ? layer >= layers.first && layer < layers.end
                                       : is_before_layers(p.name) ? s == 0 : s == pp - 1;
          if (!here) continue;
          const bool keeps_f32 = stays_f32_in_mixed_precision(NamedParameter{p.name, Tensor(), p.decay, p.group});
          const double n = static_cast<double>(p.group == "experts" ? p.shape.numel() / ep : p.shape.numel());
          const double sharded = 8.0 + (bf16 && !keeps_f32 ? 4.0 : 0.0);
          (p.group == "experts" ? expert : replicated) += sharded * n;
          full += (bf16 && !keeps_f32 ? 4.0 : 8.0) * n;  // weight + grad
        }
        const StageLedger &a = z0.stages[static_cast<size_t>(s)], &b = z1.stages[static_cast<size_t>(s)];
        CHECK(a.weight_grad_bytes == Approx(full).epsilon(1e-12));
        CHECK(b.weight_grad_bytes == a.weight_grad_bytes);
        CHECK(a.optimizer_bytes == Approx(replicated + expert).epsilon(1e-12));
        // Replicated parameters have dp x ep replicas in a stage, expert shards dp.
        const double expected = a.optimizer_bytes - replicated * (1.0 - 1.0 / static_cast<double>(dp * ep)) -
                                expert * (1.0 - 1.0 / static_cast<double>(dp));
        CHECK(b.optimizer_bytes == Approx(expected).epsilon(1e-12));
        CHECK(b.activation_bytes == a.activation_bytes);
      }
    }
  }
}

TEST_CASE("ledger: 1F1B keeps min(pp - s, M) micro-batches alive; bubble (pp - 1) / (M + pp - 1)", "[nn][ledger]") {
  const Config config = load("k3-small", {"train.dtype=bf16"});
  const int64_t n_layer = config.get_int("model.n_layer"), D = config.get_int("model.d_model");
  const int64_t S = config.get_int("model.attn_res_block_size");
  const double tokens = static_cast<double>(config.get_int("train.batch_size") * config.get_int("train.seq_len"));
  const Ledger whole = make_ledger(config, LedgerLayout{});
  for (int64_t pp : {1, 2, 4, 13}) {
    for (int64_t M : {1, 3, 8}) {
      DYNAMIC_SECTION("pp " << pp << " M " << M) {
        const Ledger l = make_ledger(config, LedgerLayout{1, 1, pp, 0, 0, M});
        CHECK(l.step.bubble == Approx(static_cast<double>(pp - 1) / static_cast<double>(M + pp - 1)));
        double layers_only = 0;
        for (int64_t s = 0; s < pp; ++s) {
          const StageLedger& st = l.stages[static_cast<size_t>(s)];
          CHECK(st.num_micro_batches_in_flight == std::min(pp - s, M));
          CHECK(st.activation_bytes == Approx(static_cast<double>(st.num_micro_batches_in_flight) *
                                              st.activation_bytes_per_micro_batch));
          // A stage past the first also holds what it received: the AttnRes blocks
          // opened before its first layer (at l % S == 0) and the hidden state, D
          // values each, bf16 (docs/model.md#attnres-schedule).
          const int64_t first = st.first_layer;
          int64_t blocks = 0;
          for (int64_t i = 0; i < first; ++i) blocks += i % S == 0;
          const double received = s == 0 ? 0.0 : static_cast<double>((blocks + 1) * D) * 2.0;
          layers_only += st.activation_bytes_per_micro_batch - tokens * received;
        }
        // The layer ranges partition the whole-model estimates.
        CHECK(layers_only == Approx(whole.activation_bytes_per_rank).epsilon(1e-9));
        double flops = 0;
        for (const StageLedger& st : l.stages) flops += st.compute_s * l.cluster.peak_flops * l.cluster.mfu / tokens;
        CHECK(flops == Approx(whole.flops_per_token).epsilon(1e-9));
        CHECK(l.step.sequences_per_step == M * config.get_int("train.batch_size"));
      }
    }
  }
  CHECK(n_layer == 13);
}

TEST_CASE("ledger: virtual stages (--pp-virtual): chunks, the interleaved schedule's memory, bubble (pp - 1) / (V M + pp - 1)",
          "[nn][ledger]") {
  const Config config = load("k3-small", {"train.dtype=bf16"});
  const HybridConfig hc = HybridConfig::from(config);
  const int64_t D = hc.d_model, S = hc.attn_res_block_size;
  const double tokens = static_cast<double>(config.get_int("train.batch_size") * config.get_int("train.seq_len"));
  const HybridModel whole(hc, 0, /*allocate=*/false);
  // pp 2 x V 2 over 13 layers: virtual stages 0-3, 4-6, 7-9, 10-12; stage 0 holds 0-3 and 7-9.
  const Ledger l = make_ledger(config, LedgerLayout{1, 1, 2, 0, 0, 4, 2});
  const StageLedger& st0 = l.stages[0];
  REQUIRE(st0.chunks.size() == 2);
  CHECK(st0.chunks[0] == std::pair<int64_t, int64_t>{0, 4});
  CHECK(st0.chunks[1] == std::pair<int64_t, int64_t>{7, 10});
  CHECK(st0.layers_text() == "0-3, 7-9");
  CHECK(l.stages[1].layers_text() == "4-6, 10-12");
  CHECK(l.step.bubble == Approx(1.0 / 9.0));
  // Chunk bytes by hand: its layers' activations plus what it received (AttnRes blocks opened before
  // it and the hidden state, bf16). The interleaved order on stage 0, M 4, is F0 F1 F0' F1' F2 B0' F3
  // B1' ... (' chunk 1): 5 pairs alive after F2 (micro-batches 0-2 in chunk 0, 0-1 in chunk 1) and again
  // after F3 (0-3 in chunk 0, 1 in chunk 1); chunk 0 has 4 layers to chunk 1's 3, so the second is the peak.
  auto received = [&](int64_t first) {
    int64_t blocks = 0;
    for (int64_t i = 0; i < first; ++i) blocks += i % S == 0;
    return first == 0 ? 0.0 : static_cast<double>((blocks + 1) * D) * 2.0;
  };
  const double c0 = tokens * whole.activation_bytes_per_token(true, 0, 4, false);
  const double c1 = tokens * (whole.activation_bytes_per_token(true, 7, 10, false) + received(7));
  CHECK(st0.num_micro_batches_in_flight == 5);
  CHECK(st0.activation_bytes == Approx(std::max(3 * c0 + 2 * c1, 4 * c0 + c1)).epsilon(1e-12));
  CHECK(st0.activation_bytes_per_micro_batch == Approx(c0 + c1).epsilon(1e-12));
  // Parameters: what the trainer's model with two chunks allocates.
  for (int64_t s = 0; s < 2; ++s) {
    HybridModel stage(hc, 0, /*allocate=*/true, ExpertShard{}, PipelineStage{s, 2, 2});
    int64_t held = 0;
    for (const NamedParameter& p : stage.parameters()) held += p.tensor.numel();
    CHECK(l.stages[static_cast<size_t>(s)].params == held);
    CHECK(stage.stage_input_count(1) * D == whole.boundary_values_per_token(stage.pipeline_stage_layers(1).first));
  }
  // The compute of a step is the model's whatever the split; p2p doubles with twice the boundaries.
  const Ledger plain = make_ledger(config, LedgerLayout{1, 1, 2, 0, 0, 4, 1});
  double a = 0, b = 0;
  for (int64_t s = 0; s < 2; ++s) {
    a += l.stages[static_cast<size_t>(s)].compute_s;
    b += plain.stages[static_cast<size_t>(s)].compute_s;
  }
  CHECK(a == Approx(b).epsilon(1e-12));
  CHECK(l.stages[0].p2p_s > plain.stages[0].p2p_s);
  CHECK(l.step.pipeline_s == Approx((4 + 1.0 / 2.0) * std::max(l.stages[0].micro_batch_s(), l.stages[1].micro_batch_s())));
  // Refusals name the flag.
  CHECK_THROWS_WITH(make_ledger(config, LedgerLayout{1, 1, 1, 0, 0, 4, 2}), Catch::Contains("needs --pp > 1"));
  CHECK_THROWS_WITH(make_ledger(config, LedgerLayout{1, 1, 2, 0, 0, 3, 2}), Catch::Contains("not a multiple of --pp 2"));
  CHECK_THROWS_WITH(make_ledger(config, LedgerLayout{1, 1, 2, 0, 0, 4, 7}), Catch::Contains("exceed the model's 13"));
}

TEST_CASE("ledger: several replicas add the gradient buckets in flight, 2 x min(bucket, the group's gradients)",
          "[nn][ledger]") {
  // Measured on k3-topology-mini at 4 ranks with layers recomputed (docs/performance.md#activation-recomputation):
  // the peak grew by about twice the bucket size (bucket 4, 32, 64 MiB).
  for (double mb : {4.0, 32.0}) {
    const Config config = load("k3-small", {fmt::format("train.grad_bucket_mb={}", mb)});
    const Ledger one = make_ledger(config, LedgerLayout{});
    CHECK(one.stages[0].grad_sync_bytes == 0);
    CHECK(one.bytes_per_rank == Approx(one.state_bytes_per_rank + one.activation_bytes_per_rank));
    const Ledger dp2 = make_ledger(config, LedgerLayout{2, 1, 1});
    const double grads = static_cast<double>(dp2.stages[0].params) * 4.0;  // f32 buckets
    CHECK(dp2.stages[0].grad_sync_bytes == Approx(2.0 * std::min(mb * 1048576.0, grads)));
    CHECK(dp2.bytes_per_rank == Approx(dp2.state_bytes_per_rank + dp2.activation_bytes_per_rank +
                                       dp2.grad_sync_bytes_per_rank));
    // ep 2 alone (dp 1): the replicated parameters are summed over the 2 ranks, the expert shards not at all.
    const Ledger ep2 = make_ledger(config, LedgerLayout{1, 2, 1});
    const StageLedger& st = ep2.stages[0];
    CHECK(st.grad_sync_bytes ==
          Approx(2.0 * std::min(mb * 1048576.0, static_cast<double>(st.params - st.expert_params) * 4.0)));
  }
}

TEST_CASE("ledger: the step estimate's traffic terms follow the rank layout", "[nn][ledger]") {
  const Config config = load("k3-small", {"train.dtype=bf16"});
  const double tokens = static_cast<double>(config.get_int("train.batch_size") * config.get_int("train.seq_len"));
  const double k = static_cast<double>(config.get_int("model.moe.top_k"));
  const double W = static_cast<double>(config.get_int("model.moe.latent_dim"));
  const int64_t first_dense = config.get_int("model.moe.first_dense_layers");
  const double num_moe_layers = static_cast<double>(config.get_int("model.n_layer") - first_dense);
  ClusterAssumptions cluster;
  // ep 4 on one node of 8: 3 of 4 shares of the rows (dispatch, combine, forward and
  // backward, bf16) go over NVLink; ep 16 over 2 nodes of 8: 8 of the 15 peers are remote.
  const double rows = tokens * num_moe_layers * 4.0 * k * W * 2.0;
  const Ledger e4 = make_ledger(config, LedgerLayout{1, 4, 1}, cluster);
  CHECK(e4.stages[0].all_to_all_s == Approx(rows * 3.0 / 4.0 / cluster.intra_bandwidth));
  const Ledger e16 = make_ledger(config, LedgerLayout{1, 16, 1}, cluster);
  CHECK(e16.stages[0].all_to_all_s ==
        Approx(std::max(rows * 7.0 / 16.0 / cluster.intra_bandwidth, rows * 8.0 / 16.0 / cluster.inter_bandwidth)));
  CHECK(make_ledger(config, LedgerLayout{4, 1, 1}, cluster).stages[0].all_to_all_s == 0);
  // ep 14 straddles nodes: the second group, ranks 14-27, has 2 ranks on node 1,
  // 8 on node 2 and 4 on node 3, so ranks 14 and 15 have 12 remote peers.
  const Config odd = load("k3-small", {"train.dtype=bf16", "model.moe.num_experts=56"});
  const Ledger e14 = make_ledger(odd, LedgerLayout{2, 14, 1}, cluster);
  CHECK(e14.stages[0].all_to_all_s ==
        Approx(std::max(rows * 1.0 / 14.0 / cluster.intra_bandwidth, rows * 12.0 / 14.0 / cluster.inter_bandwidth)));
  // Gradient all-reduce of dp 2 on one node (zero 0): 2 (R - 1) / R of the f32 gradients.
  int64_t total = 0;
  for (const ParamSpec& p : specs_of(config)) total += p.shape.numel();
  const Ledger d2 = make_ledger(config, LedgerLayout{2, 1, 1}, cluster);
  CHECK(d2.stages[0].grad_sync_s == Approx(static_cast<double>(total) * 4.0 / cluster.intra_bandwidth));
  CHECK(d2.stages[0].p2p_s == 0);
  // Compute at pp 1: tokens x FLOPs per token at the assumed rate, M micro-batches a step.
  const Ledger m4 = make_ledger(config, LedgerLayout{1, 1, 1, 0, 0, 4}, cluster);
  CHECK(m4.stages[0].compute_s == Approx(tokens * m4.flops_per_token / (cluster.peak_flops * cluster.mfu)));
  CHECK(m4.step.step_s == Approx(4.0 * m4.stages[0].compute_s));
}

TEST_CASE("ledger: --plan finds Kimi-K3 layouts on H200s, and each fits", "[nn][ledger]") {
  // bf16 with layers recomputed: docs/parallelism.md#planning-a-cluster-k3-on-h200s.
  const Config config = load("kimi-k3", {"train.dtype=bf16", "train.activation_checkpointing=true"});
  const ClusterAssumptions h200;
  PlanOptions options;
  options.devices = 1024;
  options.global_batch = 4096;
  const Plan plan = plan_layouts(config, options, h200);
  REQUIRE(!plan.feasible.empty());
  CHECK(plan.closest.empty());
  const std::vector<ParamSpec> specs = specs_of(config);
  for (size_t i = 0; i < plan.feasible.size(); ++i) {
    const Ledger& l = plan.feasible[i];
    INFO("layout " << i << ": pp " << l.layout.pp << " dp " << l.layout.dp << " ep " << l.layout.ep);
    CHECK(l.layout.ranks() == 1024);
    CHECK(l.step.sequences_per_step == 4096);
    CHECK(896 % l.layout.ep == 0);
    if (i > 0) CHECK(plan.feasible[i - 1].step.step_s <= l.step.step_s);
    // Every stage fits, not only the one reported.
    for (const StageLedger& st : l.stages) CHECK(st.total_bytes() <= h200.gpu_memory - h200.reserve);
    // The layout's own ledger agrees.
    const Ledger again = make_ledger(config, l.layout, h200);
    CHECK(again.fits);
    CHECK(again.bytes_per_rank == l.bytes_per_rank);
  }
  // Without recomputation a micro-batch of the whole model's activations (stage 0
  // holds pp micro-batches of 1/pp of the layers) does not fit at M >= pp.
  const Config stored = load("kimi-k3", {"train.dtype=bf16"});
  const Plan none = plan_layouts(stored, options, h200);
  CHECK(none.feasible.empty());
  REQUIRE(!none.closest.empty());
  for (const Ledger& l : none.closest) CHECK(!l.fits);
}

TEST_CASE("ledger: impossible layouts name the flag", "[nn][ledger]") {
  const Config tiny = load("k3-tiny"), gpt2 = load("gpt2-small");
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(message([&] { make_ledger(tiny, LedgerLayout{1, 1, 10}); }),
             Catch::Contains("--pp 10") && Catch::Contains("model.n_layer = 9"));
  CHECK_THAT(message([&] { make_ledger(tiny, LedgerLayout{1, 3, 1}); }),
             Catch::Contains("--ep 3") && Catch::Contains("model.moe.num_experts"));
  CHECK_THAT(message([&] { make_ledger(gpt2, LedgerLayout{1, 2, 1}); }), Catch::Contains("--ep 2"));
  CHECK_THAT(message([&] { make_ledger(tiny, LedgerLayout{1, 1, 1, 2}); }), Catch::Contains("--zero 2"));
  CHECK_NOTHROW(make_ledger(tiny, LedgerLayout{1, 16, 9, 1}));
}
