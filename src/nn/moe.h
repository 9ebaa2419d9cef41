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
// each expert's rows run as one GEMM (ops/moe/moe.h). The layer reads route
// (nn/router.h) -> plan -> dispatch (nn/dispatcher.h) -> experts -> combine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/dispatcher.h"
#include "nn/ffn.h"
#include "nn/moe_config.h"
#include "nn/param_factory.h"
#include "nn/router.h"
#include "ops/router/router.h"

namespace moetrain {

namespace comm {
class Communicator;
}

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
  // Counts planned on the device and not yet read (f64 [E + 1]: per expert, then
  // the dropped): summed there, read once by settle() (MoeLayer::stats() does).
  Tensor pending;
  void settle();
  void reset() {
    std::fill(tokens_per_expert.begin(), tokens_per_expert.end(), 0.0);
    dropped = 0;
    pending = Tensor();
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

class MoeLayer : public FeedForward {
 public:
  // d_model D; ffn: the activation and SiTU constants of the experts (kind, situ_*);
  // prefix e.g. "model.layers.3.mlp."; shard: this rank's experts (their weights
  // equal the same rows of an unsharded model built with the same seed).
  MoeLayer(const MoeConfig& c, int64_t d_model, const FfnConfig& ffn, double init_std, ParamFactory& factory,
           const std::string& prefix, ExpertShard shard = {});

  // The expert-parallel group (its size = shard.size, its rank = shard.index),
  // required before forward when the experts are sharded; it must outlive the
  // layer's graphs. Sharded, the layer dispatches with an AllToAllDispatcher over
  // it; unsharded (group null), with a LocalDispatcher.
  void set_expert_group(comm::Communicator* group);
  const ExpertShard& shard() const { return shard_; }

  // The dispatch and combine around `experts` (Dispatcher::dispatch): forward()
  // passes the grouped GEMMs; tests pass identity or checking functions.
  using ExpertsFn = Dispatcher::ExpertsFn;
  Tensor dispatch(const Tensor& rows_sorted, const std::vector<int64_t>& counts, const ExpertsFn& experts) const;

  // x [B, T, D] -> [B, T, D]. Adds the assignments to stats(); with training and a
  // non-zero aux/z-loss weight sets aux_loss() (a scalar to add to the loss). With
  // `routing`, also hands back the router's result (tokens in B, T order).
  Tensor forward(const Tensor& x, bool training, Routing* routing);
  Tensor forward(const Tensor& x, bool training) override { return forward(x, training, nullptr); }
  const char* component() const override { return "moe"; }

  const MoeConfig& config() const { return c_; }
  // Settled (a copy from the device when counts are pending).
  MoeStats& stats() {
    stats_.settle();
    return stats_;
  }
  // Cleared without reading what is pending (a CUDA graph's counts before any replay
  // wrote them: train/graph_step.cpp).
  void drop_stats() { stats_.reset(); }
  const Tensor& aux_loss() const { return aux_loss_; }
  // Router::update_bias.
  void update_bias(const std::vector<double>& counts) { router.update_bias(counts); }

  Router router;                 // gate.weight, gate.e_score_correction_bias
  Tensor down_proj, up_proj, latent_norm;  // latent MoE only
  Tensor w1, w2, w3;             // this rank's experts, stacked: [E / shard.size, ...]
  std::unique_ptr<DenseFfn> shared;

 private:
  Tensor experts_forward(const Tensor& z_sorted, const std::vector<int64_t>& counts) const;
  // The same on rows ranged by device offsets (ExpertRows::offsets, ops/moe/moe.h).
  Tensor experts_forward(const Tensor& z_sorted, const Tensor& offsets) const;
  // Both: the gated MLP with `gemm` (x, w) -> grouped_linear(x, w, the ranges).
  using GroupedGemm = std::function<Tensor(const Tensor& x, const Tensor& w)>;
  Tensor expert_mlp(const Tensor& z_sorted, const GroupedGemm& gemm) const;
  // The routed experts' output [N, W] for local experts, planned where the ids are:
  // no host wait on a GPU (docs/cuda.md, "Host synchronisation").
  Tensor local_experts(const Tensor& z, const Tensor& ids, const Tensor& weights, bool training);
  // The same through the host plan and the dispatcher (expert parallelism, or a
  // caller that wants the ids on the host).
  Tensor dispatched_experts(const Tensor& z, const Routing& r, int64_t N, bool training);
  int64_t capacity(int64_t N) const;
  // The experts' rows back in (token, slot) order, weighted and summed over the slots: [N, W].
  Tensor combine(const Tensor& expert_out, const ExpertPlan& plan, const Tensor& weights, int64_t N) const;

  MoeConfig c_;
  ExpertShard shard_;
  std::unique_ptr<Dispatcher> dispatcher_;
  FfnConfig ffn_;
  int64_t d_model_;
  MoeStats stats_;
  Tensor aux_loss_;
};

}  // namespace moetrain
