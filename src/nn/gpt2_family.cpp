// The gpt2 model family (model.arch gpt2): GPT-2 as docs/model.md#gpt-2-block, dense,
// one process's model (no pipeline stages, no experts), LM head tied to wte, learned
// positions. Registered in nn/model_family.cpp.
#include <fmt/format.h>

#include "core/error.h"
#include "nn/gpt2.h"
#include "nn/gpt2_hf.h"
#include "nn/model_family.h"

namespace moetrain {

const ModelFamily& gpt2_family() {
  static const ModelFamily family = [] {
    ModelFamily f;
    f.name = "gpt2";
    f.description = "GPT-2 (docs/model.md#gpt-2-block)";
    f.capabilities.pipeline_parallel = false;
    f.capabilities.expert_parallel = false;
    f.capabilities.full_recompute = true;
    f.capabilities.selective_recompute = false;
    f.capabilities.learned_positions = true;
    f.capabilities.tied_embeddings = TiedEmbeddings::always;
    f.build = [](const Config& config, const ModelPlacement& placement) -> std::unique_ptr<LanguageModel> {
      MT_ASSERT(placement.shard.size == 1 && placement.stage.whole(),
                "gpt2: built for expert shard {}/{} and stage {}/{}; check_capabilities refuses those",
                placement.shard.index, placement.shard.size, placement.stage.index, placement.stage.count);
      const Gpt2Config c = Gpt2Config::from(config);
      MT_CHECK(c.d_model % c.n_head == 0, "model.d_model = {} is not divisible by model.n_head = {}", c.d_model,
               c.n_head);
      return std::make_unique<Gpt2>(c, model_seed(config));
    };
    f.ledger_shapes = [](const Config& config, int64_t seq_len, bool mixed_precision) {
      const Gpt2Config c = Gpt2Config::from(config);
      auto model = std::make_unique<Gpt2>(c, model_seed(config), /*allocate=*/false);
      LedgerShapes s;
      bind_ledger_estimates(s, model.get(), seq_len, mixed_precision);
      s.tied = true;
      s.n_layer = c.n_layer;
      s.d_model = c.d_model;
      s.moe_layer.assign(static_cast<size_t>(c.n_layer), false);
      // bf16 on the CPU: every kernel of the step reads and writes bf16 itself; the
      // largest f32 tensor an op holds while it runs is the MLP's f32 product, [4 D] per
      // token: c_fc's in the forward (oneDNN's f32 result before the bias, GELU and
      // rounding pass; ops/linalg/linalg_cpu.cpp) and GELU's input gradient's in the
      // backward. The other biased linears' products are 3 D (c_attn) and D.
      s.cpu_widened = {fmt::format("the MLP's f32 product (c_fc forward, GELU's input gradient): 4 x {} f32 values "
                                   "per token", c.d_model),
                       4 * c.d_model};
      s.model = std::move(model);
      return s;
    };
    f.num_layers = [](const Config& config) { return config.get_int("model.n_layer"); };
    f.routed_experts = [](const Config&) { return int64_t{0}; };
    f.ties_embeddings = [](const Config&) { return true; };
    f.hf_model_types = {"gpt2"};
    f.read_hf_architecture = [](const std::string& path, const std::string&) { return gpt2_hf_architecture(path); };
    return f;
  }();
  return family;
}

}  // namespace moetrain
