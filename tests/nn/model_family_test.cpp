// The model-family registry (nn/model_family.h): lookup by model.arch and by
// Hugging Face model_type, the capabilities of gpt2 and hybrid, and the refusals
// that follow from a capability turned off (a family made here, not registered),
// plus the named parallel dimensions (comm/parallel_dims.h) the trainer reads from
// train.pp / train.ep / train.tp / train.cp.
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "comm/parallel_dims.h"
#include "config/config.h"
#include "config/schema.h"
#include "nn/model_family.h"
#include "testing.h"
#include "train/distributed.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::error_of;

namespace {

Config family_test_config(const std::string& name, const std::vector<std::string>& overrides = {}) {
  return Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + name + ".yaml", overrides);
}

// The hybrid family with one capability switched off, under another name.
ModelFamily hybrid_without(bool ModelCapabilities::*capability) {
  ModelFamily f = model_family("hybrid");
  f.name = "testfam";
  f.capabilities.*capability = false;
  return f;
}

}  // namespace

TEST_CASE("model family: the registry finds gpt2 and hybrid by model.arch and by config.json model_type", "[nn]") {
  CHECK(model_family_names() == std::vector<std::string>{"gpt2", "hybrid"});
  CHECK(model_family("gpt2").name == "gpt2");
  CHECK(model_family("hybrid").name == "hybrid");
  CHECK(&model_family(family_test_config("k3-tiny")) == &model_family("hybrid"));
  CHECK(&model_family(family_test_config("gpt2-shakespeare")) == &model_family("gpt2"));
  REQUIRE(model_family_for_hf_type("gpt2"));
  CHECK(model_family_for_hf_type("gpt2")->name == "gpt2");
  REQUIRE(model_family_for_hf_type("kimi_linear"));
  CHECK(model_family_for_hf_type("kimi_linear")->name == "hybrid");
  REQUIRE(model_family_for_hf_type("moetrain_hybrid"));
  CHECK(model_family_for_hf_type("moetrain_hybrid")->name == "hybrid");
  CHECK(model_family_for_hf_type("llama") == nullptr);
  // config/ sits below nn/ (launch/layers.txt), so the schema spells model.arch's
  // choices itself: they must be the registered families, with their descriptions.
  const KeySpec* arch = find_key_spec("model.arch");
  REQUIRE(arch);
  CHECK(arch->choices == model_family_names());
  CHECK(arch->doc == model_families_doc());
}

TEST_CASE("model family: an unknown name is an error naming model.arch and the families", "[nn]") {
  const std::string e = error_of<ConfigError>([] { model_family("llama"); });
  CHECK(e.find("model.arch = llama") != std::string::npos);
  CHECK(e.find("use one of gpt2, hybrid") != std::string::npos);
}

TEST_CASE("model family: capabilities of gpt2 and hybrid", "[nn]") {
  const ModelFamily& gpt2 = model_family("gpt2");
  CHECK_FALSE(gpt2.capabilities.pipeline_parallel);
  CHECK_FALSE(gpt2.capabilities.expert_parallel);
  CHECK(gpt2.capabilities.full_recompute);
  CHECK_FALSE(gpt2.capabilities.selective_recompute);
  CHECK(gpt2.capabilities.learned_positions);
  CHECK(gpt2.capabilities.tied_embeddings == TiedEmbeddings::always);
  const ModelFamily& hybrid = model_family("hybrid");
  CHECK(hybrid.capabilities.pipeline_parallel);
  CHECK(hybrid.capabilities.expert_parallel);
  CHECK(hybrid.capabilities.full_recompute);
  CHECK(hybrid.capabilities.selective_recompute);
  CHECK_FALSE(hybrid.capabilities.learned_positions);
  CHECK(hybrid.capabilities.tied_embeddings == TiedEmbeddings::optional);
  CHECK(families_with(&ModelCapabilities::pipeline_parallel) == "model.arch hybrid");
  CHECK(families_with(&ModelCapabilities::full_recompute) == "model.arch gpt2 or hybrid");

  // What the families read of a config: layers, routed experts, tying.
  const Config k3 = family_test_config("k3-tiny");
  CHECK(hybrid.num_layers(k3) == k3.get_int("model.n_layer"));
  CHECK(hybrid.routed_experts(k3) == 16);
  CHECK(hybrid.ties_embeddings(family_test_config("k3-tiny", {"model.tie_embeddings=true"})));
  CHECK_FALSE(hybrid.ties_embeddings(family_test_config("k3-tiny", {"model.tie_embeddings=false"})));
  const Config g = family_test_config("gpt2-shakespeare");
  CHECK(gpt2.routed_experts(g) == 0);
  CHECK(gpt2.ties_embeddings(g));
  CHECK(gpt2.num_layers(g) == g.get_int("model.n_layer"));

  // The builder gives the family's model, and the ledger's view its shapes.
  const Config small = family_test_config("gpt2-shakespeare", {"model.n_layer=1", "model.d_model=32", "model.n_head=2",
                                                               "model.vocab_size=64", "model.n_ctx=16",
                                                               "train.seq_len=16"});
  CHECK(gpt2.build(small, {})->arch() == "gpt2");
  CHECK(hybrid.build(k3, {})->arch() == "hybrid");
  const LedgerShapes shapes = hybrid.ledger_shapes(k3, 32, false);
  CHECK(shapes.experts == 16);
  CHECK(shapes.n_layer == k3.get_int("model.n_layer"));
  CHECK(static_cast<int64_t>(shapes.moe_layer.size()) == shapes.n_layer);
  REQUIRE(shapes.specs);
  CHECK_FALSE(shapes.specs->empty());
}

TEST_CASE("model family: the refusals come from the capabilities, naming the key and its origin", "[nn]") {
  const Config pp = family_test_config("k3-tiny", {"train.pp=2"});
  const Config ep = family_test_config("k3-tiny", {"train.ep=2"});
  const Config act = family_test_config("k3-tiny", {"train.recompute_modules=act"});
  const Config full = family_test_config("k3-tiny", {"train.activation_checkpointing=true"});
  // The hybrid can do all four.
  for (const Config* c : {&pp, &ep, &act, &full}) CHECK_NOTHROW(check_capabilities(*c, model_family("hybrid")));

  std::string e = error_of<ConfigError>(
      [&] { check_capabilities(pp, hybrid_without(&ModelCapabilities::pipeline_parallel)); });
  CHECK(e.find("--set train.pp=2: train.pp = 2: pipeline parallelism needs model.arch hybrid; model.arch testfam has "
               "no pipeline stages") == 0);
  e = error_of<ConfigError>([&] { check_capabilities(ep, hybrid_without(&ModelCapabilities::expert_parallel)); });
  CHECK(e.find("--set train.ep=2: train.ep = 2: expert parallelism needs model.arch hybrid") == 0);
  CHECK(e.find("model.arch testfam has no routed experts") != std::string::npos);
  e = error_of<ConfigError>([&] { check_capabilities(act, hybrid_without(&ModelCapabilities::selective_recompute)); });
  CHECK(e.find("--set train.recompute_modules=act: train.recompute_modules = act: is for model.arch hybrid; "
               "model.arch testfam recomputes whole blocks only") == 0);
  e = error_of<ConfigError>([&] { check_capabilities(full, hybrid_without(&ModelCapabilities::full_recompute)); });
  CHECK(e.find("train.activation_checkpointing = true: is for model.arch gpt2 or hybrid; model.arch testfam cannot "
               "recompute") != std::string::npos);
  // The ledger (layout false) estimates layouts the family cannot run; recomputation it still refuses.
  CHECK_NOTHROW(check_capabilities(pp, hybrid_without(&ModelCapabilities::pipeline_parallel), /*layout=*/false));
  CHECK_NOTHROW(check_capabilities(ep, hybrid_without(&ModelCapabilities::expert_parallel), /*layout=*/false));
  CHECK_THROWS_AS(check_capabilities(act, hybrid_without(&ModelCapabilities::selective_recompute), false), ConfigError);

  // GPT-2's refusals, through the same check.
  const Config gpt2_pp = family_test_config("gpt2-shakespeare", {"train.pp=2"});
  e = error_of<ConfigError>([&] { check_capabilities(gpt2_pp, model_family("gpt2")); });
  CHECK(e.find("train.pp = 2: pipeline parallelism needs model.arch hybrid; model.arch gpt2 has no pipeline stages") !=
        std::string::npos);
  e = error_of<ConfigError>(
      [&] { check_capabilities(family_test_config("gpt2-shakespeare", {"train.ep=2"}), model_family("gpt2")); });
  CHECK(e.find("--set train.ep=2: train.ep = 2: expert parallelism needs model.arch hybrid with MoE layers") == 0);
  // ... and where the trainer and build_model meet them: before the world's divisibility
  // (one process here, which 2 stages would not divide).
  e = error_of<ConfigError>([&] { make_distributed(gpt2_pp); });
  CHECK(e.find("model.arch gpt2 has no pipeline stages") != std::string::npos);
  e = error_of<ConfigError>([&] { build_model(family_test_config("gpt2-shakespeare", {"train.recompute_modules=act"})); });
  CHECK(e.find("model.arch gpt2 recomputes whole blocks only") != std::string::npos);
}

TEST_CASE("model family: the model must be cut as train.pp and train.ep ask", "[nn]") {
  const ModelFamily& hybrid = model_family("hybrid");
  const std::vector<std::string> two = {"model.n_layer=2", "model.layer_mixers=kda,mla"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), two.begin(), two.end());
    return family_test_config("k3-tiny", more);
  };
  CHECK_NOTHROW(check_parallel_fit(with({"train.pp=2", "train.ep=16"}), hybrid));
  CHECK(error_of<ConfigError>([&] { check_parallel_fit(with({"train.pp=3"}), hybrid); })
            .find("--set train.pp=3: train.pp = 3: exceeds the model's 2 layers") == 0);
  CHECK_NOTHROW(check_parallel_fit(with({"train.pp=2", "train.pp_virtual=1"}), hybrid));
  CHECK(error_of<ConfigError>([&] { check_parallel_fit(with({"train.pp=2", "train.pp_virtual=2"}), hybrid); })
            .find("--set train.pp_virtual=2: train.pp_virtual = 2: gives train.pp x train.pp_virtual = 4 virtual "
                  "stages, more than the model's 2 layers") == 0);
  CHECK(error_of<ConfigError>([&] { check_parallel_fit(with({"train.ep=3"}), hybrid); })
            .find("train.ep = 3: does not divide model.moe.num_experts = 16") != std::string::npos);
  CHECK(error_of<ConfigError>([&] { check_parallel_fit(with({"model.moe.num_experts=0", "train.ep=2"}), hybrid); })
            .find("train.ep = 2: expert parallelism needs MoE layers") != std::string::npos);
}

TEST_CASE("parallel dims: named degrees validated once; tp and cp refused as not implemented", "[nn]") {
  comm::ParallelDegrees d;
  d.pp = 2;
  d.ep = 2;
  const comm::ParallelDims dims = comm::make_parallel_dims(8, d);
  CHECK(dims.world == 8);
  CHECK(dims.pp == 2);
  CHECK(dims.ep == 2);
  CHECK(dims.dp == 2);
  CHECK(dims.tp == 1);
  CHECK(dims.cp == 1);
  CHECK(dims.stage_ranks() == 4);
  d.ep = 3;
  CHECK(error_of([&] { comm::make_parallel_dims(8, d); })
            .find("train.ep = 3: does not divide the 4 ranks of a pipeline stage (8 ranks / train.pp = 2)") == 0);
  d.ep = 1;
  d.tp = 2;
  CHECK(error_of([&] { comm::make_parallel_dims(8, d); })
            .find("train.tp = 2: tensor parallelism is not implemented") == 0);
  d.tp = 1;
  d.pp = 1;
  d.pp_virtual = 2;
  CHECK(error_of([&] { comm::make_parallel_dims(8, d); })
            .find("train.pp_virtual = 2: needs train.pp > 1") == 0);
  d.pp = 2;
  CHECK(comm::make_parallel_dims(8, d).pp_virtual == 2);  // virtual stages add no ranks
  CHECK(comm::make_parallel_dims(8, d).dp == 4);
  d.pp_virtual = 1;
  d.cp = 4;
  CHECK(error_of([&] { comm::make_parallel_dims(8, d); })
            .find("train.cp = 4: context parallelism is not implemented") == 0);

  // From a config: the key's origin leads the message (Config::fail, exit 2).
  const Config k3 = family_test_config("k3-tiny", {"train.ep=2", "train.pp=2"});
  const comm::ParallelDims from_config = parallel_dims(k3, 8);
  CHECK(from_config.pp == 2);
  CHECK(from_config.ep == 2);
  CHECK(from_config.dp == 2);
  CHECK(error_of<ConfigError>([&] { parallel_dims(family_test_config("k3-tiny", {"train.tp=2"}), 8); })
            .find("--set train.tp=2: train.tp = 2: tensor parallelism is not implemented") == 0);
  // 2 ranks in 2 stages leave 1 per stage, which ep 2 does not divide.
  CHECK(error_of<ConfigError>([&] { parallel_dims(k3, 2); })
            .find("--set train.ep=2: train.ep = 2: does not divide the 1 ranks of a pipeline stage") == 0);
  CHECK(error_of<ConfigError>([&] { parallel_dims(k3, 3); })
            .find("--set train.pp=2: train.pp = 2: does not divide the 3 ranks of this run") == 0);
}

TEST_CASE("model family: config.json's model_type picks the family's reader; an unknown one lists the registry's",
          "[nn]") {
  testing::TempDir dir;
  const std::string llama = dir.write("llama/config.json", R"({"model_type": "llama", "hidden_size": 64})");
  const std::string e = error_of([&] { read_hf_architecture(llama); });
  CHECK(e.find(llama + ": model_type \"llama\" is not one moetrain reads (gpt2, kimi_linear, moetrain_hybrid)") == 0);
  // GPT-2's reader, also for a config.json from before transformers wrote model_type.
  const std::string gpt2 = dir.write("gpt2/config.json", R"({"vocab_size": 64, "n_positions": 16, "n_embd": 32,
      "n_layer": 2, "n_head": 2, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"})");
  const HfArchitecture a = read_hf_architecture(gpt2);
  CHECK(a.model_type == "gpt2");
  REQUIRE_FALSE(a.keys.empty());
  CHECK(a.keys.front() == std::pair<std::string, std::string>{"model.arch", "gpt2"});
}
