// Mixture-of-Experts FFN (docs/model.md#moe), HF Kimi names:
//   router  logits = x Wr^T (gate.weight [E, D]), s = σ(logits) or softmax(logits)
//           I = top-k of s + b (b = gate.e_score_correction_bias: selection only, a
//           buffer moved by the aux-loss-free update, never by the optimizer)
//           w_e = ρ · s_e / (Σ_{j∈I} s_j + 1e-20)   (renormalised when k > 1)
//   latent  z = x Wdown^T (routed_expert_down_proj [L, D]); plain MoE: z = x
//   experts y_lat = Σ_{e∈I} w_e Expert_e(z),  Expert_e(z) = act(z W1e^T, z W3e^T) W2e^T
//           (experts.w1/w3 [E, F, L], experts.w2 [E, L, F]: all experts of a layer in
//           one tensor, HF's experts.{j}.w1.weight is row j)
//   latent  y = RMSNorm(y_lat; routed_expert_norm) Wup^T (routed_expert_up_proj [D, L])
//   shared  y += Shared(x) (shared_experts.{gate,up,down}_proj: one MLP of width F·n_shared)
// Expert compute is grouped: the (token, slot) assignments are sorted by expert and
// each expert's rows run as one GEMM (ops/moe/moe.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/ffn.h"
#include "nn/param_factory.h"

namespace moetrain {

namespace comm {
class Communicator;
}

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
};

// Top-k selection (no gradient): for each of the N rows of scores + bias [N, E],
// in double, the k first in the order NaN, then larger, then the lower index;
// group-limited when n_group > 1 (groups ranked in the same order by the sum of
// their two first biased scores, the first topk_group kept). Returns N·k expert
// ids, row-major (token, slot), each row in that order. CUDA scores are ranked
// on the GPU (ops/router/router_kernels.h, the same picks) and only the ids come back.
std::vector<int64_t> select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group = 1,
                                    int64_t topk_group = 1);

struct Routing {
  Tensor logits;                 // [N, E]
  Tensor scores;                 // [N, E] s
  std::vector<int64_t> experts;  // N·k selected expert ids (token-major)
  Tensor weights;                // [N, k] w (differentiable through the selected s)
};

// The router of docs/model.md#moe-router on x [N, D] with gate.weight [E, D] and the bias [E].
Routing route(const Tensor& x, const Tensor& gate_weight, const Tensor& bias, const MoeConfig& c);

// The (token, slot) assignments sorted by expert (stable: token order within an
// expert). order[i] = assignment index n·k + j of sorted row i; counts[e] rows per
// expert. With capacity (> 0 rows per expert) the later assignments of a full expert
// are dropped: they are not in `order`, and `dropped` counts them.
struct ExpertPlan {
  std::vector<int64_t> order;
  std::vector<int64_t> counts;
  int64_t dropped = 0;
};
ExpertPlan plan_experts(const std::vector<int64_t>& experts, int64_t num_experts, int64_t capacity = 0);

// Per-layer routing statistics since the last reset (the optimizer step).
struct MoeStats {
  std::vector<double> tokens_per_expert;  // assignments per expert
  int64_t dropped = 0;
  void reset() {
    std::fill(tokens_per_expert.begin(), tokens_per_expert.end(), 0.0);
    dropped = 0;
  }
};

// Load balance of one layer's assignments per expert: max / mean (1 = balanced)
// and the number of experts that got none.
struct MoeLoad {
  double max_over_mean = 0;
  int64_t dead = 0;
};
MoeLoad moe_load(const std::vector<double>& tokens_per_expert);

// Expert parallelism: the experts are split over `size` ranks in contiguous
// ranges; this rank holds experts [index·E/size, (index+1)·E/size).
struct ExpertShard {
  int index = 0, size = 1;
};

class MoeLayer {
 public:
  // d_model D; ffn: the activation and SiTU constants of the experts (kind, situ_*);
  // prefix e.g. "model.layers.3.mlp."; shard: this rank's experts (their weights
  // equal the same rows of an unsharded model built with the same seed).
  MoeLayer(const MoeConfig& c, int64_t d_model, const FfnConfig& ffn, double init_std, ParamFactory& factory,
           const std::string& prefix, ExpertShard shard = {});

  // The expert-parallel group (its size = shard.size, its rank = shard.index),
  // required before forward when the experts are sharded; it must outlive the
  // layer's graphs. Dispatch: rows to the ranks that hold their experts, an
  // all_to_all_v (autograd: the backward is the reverse exchange), a local
  // re-grouping by expert, the grouped GEMMs, and the reverse exchange.
  void set_expert_group(comm::Communicator* group);
  const ExpertShard& shard() const { return shard_; }

  // The dispatch and combine around `experts`: rows sorted by global expert
  // (counts[e] rows for expert e, all E) travel to the ranks holding their
  // experts, which call experts(rows grouped by local expert, rows per local
  // expert) and the results come back in the input's order. forward() passes the
  // grouped GEMMs; tests pass identity or checking functions.
  using ExpertsFn = std::function<Tensor(const Tensor& rows, const std::vector<int64_t>& local_counts)>;
  Tensor dispatch(const Tensor& rows_sorted, const std::vector<int64_t>& counts, const ExpertsFn& experts) const;

  // x [B, T, D] -> [B, T, D]. Adds the assignments to stats(); with training and a
  // non-zero aux/z-loss weight sets aux_loss() (a scalar to add to the loss). With
  // `routing`, also hands back the router's result (tokens in B, T order).
  Tensor forward(const Tensor& x, bool training, Routing* routing = nullptr);

  const MoeConfig& config() const { return c_; }
  MoeStats& stats() { return stats_; }
  const Tensor& aux_loss() const { return aux_loss_; }
  // The aux-loss-free update (docs/model.md#aux-loss-free-bias-update) from `counts` (assignments per expert, summed
  // over all ranks and micro-batches): b += Δ − mean(Δ), Δ = γ sign(mean − counts).
  void update_bias(const std::vector<double>& counts);

  Tensor gate_weight, bias;      // bias: gate.e_score_correction_bias [E], a buffer (no grad)
  Tensor down_proj, up_proj, latent_norm;  // latent MoE only
  Tensor w1, w2, w3;             // this rank's experts, stacked: [E / shard.size, ...]
  std::unique_ptr<DenseFfn> shared;

 private:
  Tensor experts_forward(const Tensor& z_sorted, const std::vector<int64_t>& counts) const;

  MoeConfig c_;
  ExpertShard shard_;
  comm::Communicator* ep_ = nullptr;
  mutable bool logged_sizes_ = false;  // the first dispatch's sizes go to the debug log
  FfnConfig ffn_;
  int64_t d_model_;
  MoeStats stats_;
  Tensor aux_loss_;
};

RouterScore parse_router_score(const std::string& name);

}  // namespace moetrain
