// The MoE router (nn/router.h). Differentiable parts are compositions of
// gradient-checked ops (linear, sigmoid/softmax, gather_last); the selection is
// ops/router's select_experts.
#include "nn/router.h"

#include <cstring>
#include <numeric>

#include "core/grad_mode.h"
#include "core/graph_capture.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/reduce/reduce.h"
#include "ops/router/route_weights.h"
#include "ops/router/router.h"
#include "ops/softmax/softmax.h"
#include "ops/topk/topk.h"
#include "ops/view/view.h"

namespace moetrain {

PendingRouting begin_route(const Tensor& x, const Tensor& gate_weight, const Tensor& bias, const MoeConfig& c,
                           bool ids_to_host) {
  MT_CHECK(x.dim() == 2 && gate_weight.dim() == 2 && x.size(1) == gate_weight.size(1),
           "moe router: x {} must be [N, D] and gate.weight {} [E, D]", x.shape(), gate_weight.shape());
  // Mixed precision: gate.weight stays f32 and x is widened to it, so logits,
  // scores and top-k are f32 (docs/model.md#moe-router); otherwise x already has the weight's dtype.
  Tensor logits = linear(x.to(gate_weight.dtype()), gate_weight);  // [N, E]
  Tensor scores = c.score == RouterScore::sigmoid ? sigmoid(logits) : softmax(logits);
  SelectedExperts experts = [&] {
    NoGradGuard no_grad;
    return start_select_experts(scores.detach(), bias, c.top_k, c.n_group, c.topk_group, ids_to_host);
  }();
  // The selected s, read with the ids where they were made (no host indices):
  // its gradient is a plain per-row scatter.
  Tensor w = gather_last(scores, experts.tensor());  // [N, k]
  if (c.renormalize && c.top_k > 1) w = renormalize_rows(w, 1e-20);  // w / (Σ_slots w + 1e-20), one kernel
  if (c.routed_scaling_factor != 1.0) w = mul_scalar(w, c.routed_scaling_factor);
  return {std::move(logits), std::move(scores), std::move(w), std::move(experts)};
}

Routing finish_route(PendingRouting&& pending) {
  Routing r;
  r.logits = std::move(pending.logits);
  r.scores = std::move(pending.scores);
  r.weights = std::move(pending.weights);
  r.experts = pending.experts.ids();
  r.selected = pending.experts.tensor();
  return r;
}

Routing route(const Tensor& x, const Tensor& gate_weight, const Tensor& bias, const MoeConfig& c) {
  return finish_route(begin_route(x, gate_weight, bias, c));
}

// The device copy of the bias and the host values it holds (shadow).
struct Router::DeviceBias {
  Tensor on_device, shadow;

  // Brought in step with the host buffer `bias` (a copy in place when it changed:
  // the same device memory, which a graph reads).
  void refresh(const Tensor& bias, const Device& device) {
    if (!on_device.defined() || on_device.device() != device) {
      on_device = bias.to(device);
      shadow = bias.clone();
      return;
    }
    if (std::memcmp(shadow.raw_data(), bias.raw_data(), static_cast<size_t>(bias.numel()) * 4) == 0) return;
    copy_(on_device, bias);
    copy_(shadow, bias);
  }
};

Tensor Router::bias_on(const Device& device) const {
  if (bias.device() == device) return bias;
  MT_ASSERT(bias.is_cpu() && bias.dtype() == DType::f32, "router bias {}: a host f32 buffer",
            describe(bias));
  if (!graph::capturing()) {
    device_bias_->refresh(bias, device);
  } else {
    // Captured: the copy must exist (the step before the capture made it); each
    // replay refreshes it first, as this call does eagerly.
    if (!device_bias_->on_device.defined() || device_bias_->on_device.device() != device)
      graph::refuse_if_capturing("the router's first copy of its bias to the GPU");
    graph::before_replay([held = device_bias_, host = bias, device] { held->refresh(host, device); });
  }
  return device_bias_->on_device;
}

Router::Router(const MoeConfig& c, int64_t D, double init_std, ParamFactory& f, const std::string& p)
    : c_(c), device_bias_(std::make_shared<DeviceBias>()) {
  gate_weight = f.make(p + "gate.weight", {c.num_experts, D}, Init::trunc_normal(init_std), "router", true);
  bias = f.buffer(p + "gate.e_score_correction_bias", {c.num_experts}, DType::f32);
}

Tensor Router::aux_loss(const Routing& r, int64_t B, int64_t T) const {
  const int64_t N = B * T, E = c_.num_experts, k = c_.top_k;
  Tensor loss;
  if (c_.aux_loss_weight > 0) {
    // Sequence-wise balance loss (docs/model.md#moe-auxiliary-losses): α Σ_i f_i P_i per sequence, mean
    // over the B sequences.
    // f_i = E / (k T) times the sequence's assignments to expert i, counted where the
    // ids are (in f64; no wait for a GPU).
    MT_CHECK(r.selected.defined() && r.selected.shape() == Shape({N, k}),
             "moe aux loss: the selected ids {} must be [{}, {}]", r.selected.shape(), N, k);
    const Tensor f = mul_scalar(sum(reshape(index_counts(r.selected, E, DType::f64), {B, T, E}), 1),
                                static_cast<double>(E) / static_cast<double>(k * T));  // [B, E], no gradient
    Tensor P = mean(reshape(div(r.scores, sum(r.scores, -1, true)), {B, T, E}), 1);  // [B, E]
    loss = mul_scalar(sum(mul(P, f.to(P.dtype()))), c_.aux_loss_weight / static_cast<double>(B));
  }
  if (c_.z_loss_weight > 0) {
    // z-loss: mean over tokens of logsumexp(logits)^2 (lse = x_0 − log_softmax(x)_0).
    Tensor lse = sub(slice(r.logits, -1, 0, 1), slice(log_softmax(r.logits), -1, 0, 1));
    Tensor z_loss = mul_scalar(mean(square(lse)), c_.z_loss_weight);
    loss = loss.defined() ? add(loss, z_loss) : z_loss;
  }
  return loss;
}

void Router::update_bias(const std::vector<double>& counts) {
  const int64_t E = c_.num_experts;
  MT_CHECK(static_cast<int64_t>(counts.size()) == E, "moe bias update: {} counts for {} experts", counts.size(), E);
  if (c_.bias_update_rate <= 0) return;
  const double mean_count = std::accumulate(counts.begin(), counts.end(), 0.0) / static_cast<double>(E);
  std::vector<double> delta(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const double d = mean_count - counts[e];
    delta[e] = c_.bias_update_rate * static_cast<double>((d > 0) - (d < 0));
  }
  const double mean_delta = std::accumulate(delta.begin(), delta.end(), 0.0) / static_cast<double>(E);
  float* b = bias.data<float>();
  for (int64_t e = 0; e < E; ++e) b[e] = static_cast<float>(static_cast<double>(b[e]) + delta[e] - mean_delta);
}

RouterScore parse_router_score(const std::string& name) {
  if (name == "sigmoid") return RouterScore::sigmoid;
  if (name == "softmax") return RouterScore::softmax;
  MT_THROW("unknown router score '{}' (sigmoid, softmax)", name);
}

}  // namespace moetrain
