// The MoE router (docs/model.md#moe-router): owns the gate and the expert bias,
// scores tokens and selects their experts, computes the auxiliary losses of a
// routing (docs/model.md#moe-auxiliary-losses) and moves the bias
// (docs/model.md#aux-loss-free-bias-update). HF Kimi names: gate.weight [E, D],
// gate.e_score_correction_bias [E] (a buffer: selection only, never the optimizer's).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/moe_config.h"
#include "nn/param_factory.h"
#include "ops/router/router.h"

namespace moetrain {

struct Routing {
  Tensor logits;                 // [N, E]
  Tensor scores;                 // [N, E] s
  std::vector<int64_t> experts;  // N·k selected expert ids (token-major); on the host (finish_route)
  Tensor selected;               // the same ids [N, k] i64 where the scores are
  Tensor weights;                // [N, k] w (differentiable through the selected s)
};

// The router of docs/model.md#moe-router on x [N, D] with gate.weight [E, D] and the bias [E]:
// s = σ(x Wr^T) or softmax, I = top-k of s + b, w_e = ρ · s_e / (Σ_{j∈I} s_j + 1e-20)
// (renormalised when k > 1).
Routing route(const Tensor& x, const Tensor& gate_weight, const Tensor& bias, const MoeConfig& c);

// route() in two steps (docs/cuda.md, "Host synchronisation"): begin_route queues
// the logits, the scores, the selection and the weights (on a GPU the ids start
// their way to the host unless ids_to_host is false); finish_route waits for the
// ids. The MoE layer queues the work that does not need them in between, or, with
// its experts all local, plans on the device and never waits (nn/moe.cpp).
struct PendingRouting {
  Tensor logits, scores, weights;
  SelectedExperts experts;
};
PendingRouting begin_route(const Tensor& x, const Tensor& gate_weight, const Tensor& bias, const MoeConfig& c,
                           bool ids_to_host = true);
Routing finish_route(PendingRouting&& pending);

class Router {
 public:
  // prefix e.g. "model.layers.3.mlp."
  Router(const MoeConfig& c, int64_t d_model, double init_std, ParamFactory& factory, const std::string& prefix);

  // x [N, D].
  Routing route(const Tensor& x) const { return moetrain::route(x, gate_weight, bias_on(x.device()), c_); }
  PendingRouting begin_route(const Tensor& x, bool ids_to_host = true) const {
    return moetrain::begin_route(x, gate_weight, bias_on(x.device()), c_, ids_to_host);
  }
  Routing finish_route(PendingRouting&& pending) const { return moetrain::finish_route(std::move(pending)); }
  // The auxiliary losses of a routing of B sequences of T tokens: the sequence-wise
  // balance loss (moe.aux_loss_weight) plus the z-loss (moe.z_loss_weight); a scalar
  // to add to the loss, undefined when both weights are 0.
  Tensor aux_loss(const Routing& r, int64_t B, int64_t T) const;
  // The aux-loss-free update from `counts` (assignments per expert, summed over all
  // ranks and micro-batches): b += Δ − mean(Δ), Δ = γ sign(mean − counts).
  void update_bias(const std::vector<double>& counts);

  Tensor gate_weight, bias;  // bias: a host buffer (update_bias and checkpoints write it there)

  // The bias on `device`: `bias` itself on the host; on a GPU a copy kept there and
  // refreshed in place whenever the host values changed, so routing uploads nothing
  // per call and a CUDA graph's replay reads the current values (nn/router.cpp).
  Tensor bias_on(const Device& device) const;

 private:
  struct DeviceBias;
  MoeConfig c_;
  std::shared_ptr<DeviceBias> device_bias_;
};

}  // namespace moetrain
