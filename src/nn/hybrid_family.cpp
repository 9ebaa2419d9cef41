// The hybrid model family (model.arch hybrid): the K3-style decoder of KDA / MLA /
// attention mixers with dense or MoE feed-forwards (docs/model.md#block-attnres to
// #full-decoder); pipeline stages, expert shards, full and selective recomputation.
// Registered in nn/model_family.cpp.
#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "nn/hf_adapter.h"
#include "nn/hybrid.h"
#include "nn/hybrid_hf.h"
#include "nn/model_family.h"

namespace moetrain {

const ModelFamily& hybrid_family() {
  static const ModelFamily family = [] {
    ModelFamily f;
    f.name = "hybrid";
    f.description = "the K3-style decoder of KDA / MLA / attention mixers (docs/model.md#block-attnres to #full-decoder)";
    f.capabilities.pipeline_parallel = true;
    f.capabilities.expert_parallel = true;
    f.capabilities.full_recompute = true;
    f.capabilities.selective_recompute = true;
    f.capabilities.learned_positions = false;
    f.capabilities.tied_embeddings = TiedEmbeddings::optional;
    f.build = [](const Config& config, const ModelPlacement& placement) -> std::unique_ptr<LanguageModel> {
      return std::make_unique<HybridModel>(HybridConfig::from(config), model_seed(config), true, placement.shard,
                                           placement.stage);
    };
    f.ledger_shapes = [](const Config& config, int64_t seq_len, bool mixed_precision) {
      const HybridConfig c = HybridConfig::from(config);
      auto model = std::make_unique<HybridModel>(c, model_seed(config), /*allocate=*/false);
      const HybridModel* p = model.get();
      LedgerShapes s;
      bind_ledger_estimates(s, p, seq_len, mixed_precision);
      s.selective_flops = [p](int64_t first, int64_t end) { return p->selective_recompute_flops_per_token(first, end); };
      s.experts = c.moe.num_experts;
      s.top_k = c.moe.top_k;
      s.moe_width = c.moe.latent_dim > 0 ? c.moe.latent_dim : c.d_model;
      s.tied = c.tie_embeddings;
      s.n_layer = c.n_layer();
      s.d_model = c.d_model;
      for (int64_t l = 0; l < s.n_layer; ++l) s.moe_layer.push_back(c.is_moe_layer(l));
      // bf16 on the CPU: every kernel of the step reads and writes bf16 itself (MLA's
      // rope key sum included) and the linears have no bias, so their products are
      // written in bf16 by oneDNN: no f32 transient per token is counted
      // (LedgerShapes::cpu_widened stays empty). KDA computes in f32 in a bf16 model:
      // those are its activations, not a transient of a bf16 op.
      s.model = std::move(model);
      return s;
    };
    f.num_layers = [](const Config& config) { return HybridConfig::from(config).n_layer(); };
    f.routed_experts = [](const Config& config) { return config.get_int("model.moe.num_experts"); };
    f.ties_embeddings = [](const Config& config) { return config.get_bool("model.tie_embeddings"); };
    f.hf_model_types = {"kimi_linear", kMoetrainHybridModelType};
    f.read_hf_architecture = [](const std::string& path, const std::string& model_type) {
      HfArchitecture a = hybrid_hf_architecture(read_hybrid_hf_config(path));
      a.model_type = model_type;
      return a;
    };
    return f;
  }();
  return family;
}

}  // namespace moetrain
