// The settings of an MoE layer (model.moe.*: docs/configs.md), shared by the
// router, the dispatch and the experts (nn/moe.h).
#pragma once

#include <cstdint>
#include <string>

namespace moetrain {

enum class RouterScore { sigmoid, softmax };

struct MoeConfig {
  int64_t num_experts = 0;  // E; 0: dense FFN everywhere
  int64_t top_k = 8;
  int64_t num_shared_experts = 1;
  int64_t expert_d_ff = 0;  // F, per expert (and per shared expert)
  int64_t latent_dim = 0;   // L; 0: plain MoE on the full width
  bool latent_norm = true;
  double latent_norm_eps = 1e-5;  // routed_expert_norm (docs/model.md#rmsnorm: rms_norm_eps)
  int64_t first_dense_layers = 1;
  RouterScore score = RouterScore::sigmoid;
  bool renormalize = true;
  double routed_scaling_factor = 1.0;  // ρ
  int64_t n_group = 1, topk_group = 1;  // group-limited selection (off when n_group == 1)
  double bias_update_rate = 1e-3;       // γ of the aux-loss-free update (0: off)
  double aux_loss_weight = 0.0;         // α of the sequence-wise balance loss
  double z_loss_weight = 0.0;           // router z-loss
  double capacity_factor = 0.0;         // 0: dropless
  // train.recompute_modules experts: each routed expert's MLP (gate, up, activation,
  // down) runs again in backward; only its input and output rows are kept.
  bool recompute_experts = false;
};

RouterScore parse_router_score(const std::string& name);

}  // namespace moetrain
