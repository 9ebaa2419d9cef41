#include "train/graph_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <spdlog/spdlog.h>

#include "backend/cuda/graph.h"
#include "backend/cuda/runtime.h"
#include "core/format.h"
#include "core/grad_mode.h"
#include "core/graph_capture.h"
#include "nn/language_model.h"
#include "nn/moe.h"
#include "ops/elementwise/elementwise.h"
#include "ops/reduce/reduce.h"
#include "ops/view/view.h"

namespace moetrain {

CudaGraphMode parse_cuda_graph_mode(const std::string& name) {
  if (name == "auto") return CudaGraphMode::auto_;
  if (name == "on") return CudaGraphMode::on;
  if (name == "off") return CudaGraphMode::off;
  MT_THROW("unknown train.cuda_graph '{}' (auto, on, off)", name);
}

// What the check compares between a replay and the eager step on the same input.
struct GraphStep::Print {
  double loss = 0;
  std::vector<double> grad_norms;               // per parameter, -1 without a gradient
  std::vector<std::vector<double>> moe_counts;  // per MoE layer: per expert, then the dropped
  std::vector<std::vector<double>> max_logits;  // per QK-Clip site (empty: none recorded)
};

namespace {

// The micro-batch with every row's tokens rolled left by one (inputs and targets
// alike): valid ids, other positions, so a replay that read the batch the capture
// saw, instead of the one in its buffers, differs from the eager step.
data::Batch rolled(const data::Batch& b) {
  auto roll = [](const Tensor& t) {
    MT_ASSERT(t.is_cpu() && t.dtype() == DType::i32 && t.dim() == 2, "graph check: a batch tensor {}", describe(t));
    Tensor out = empty(t.shape(), DType::i32);
    const int64_t rows = t.size(0), T = t.size(1);
    const int32_t* src = t.data<int32_t>();
    int32_t* dst = out.data<int32_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < T; ++i) dst[r * T + i] = src[r * T + (i + 1) % T];
    return out;
  };
  return {roll(b.inputs), roll(b.targets)};
}

double relative_difference(double a, double b) {
  if (a == b) return 0;
  if (!std::isfinite(a) || !std::isfinite(b)) return INFINITY;
  return std::abs(a - b) / std::max(std::abs(a), std::abs(b));
}

}  // namespace

GraphStep::GraphStep(LanguageModel& model, Device device, CudaGraphMode mode, Body body)
    : model_(model), device_(device), mode_(mode), body_(std::move(body)) {
  MT_ASSERT(device.is_cuda() && mode != CudaGraphMode::off, "GraphStep on {} with train.cuda_graph off", device);
}

GraphStep::~GraphStep() = default;

// The batch into the buffers the graph reads: made at the first call, the same
// memory from then on (a replay reads their addresses).
void GraphStep::upload(const std::vector<data::Batch>& batches) {
  if (ids_.empty()) {
    for (const data::Batch& b : batches) {
      ids_.push_back(empty(b.inputs.shape(), b.inputs.dtype(), device_));
      targets_.push_back(empty(b.targets.shape(), b.targets.dtype(), device_));
    }
  }
  for (size_t m = 0; m < batches.size(); ++m) {
    copy_(ids_[m], batches[m].inputs);
    copy_(targets_[m], batches[m].targets);
  }
}

// The host state a step leaves that the next one starts without: gradients, MoE
// counts not yet read, max logits.
void GraphStep::clear_step_state() {
  for (const NamedParameter& p : model_.parameters()) p.tensor.zero_grad();
  for (MoeLayer* m : model_.moe_layers()) m->drop_stats();
  model_.reset_max_logits();
}

Tensor GraphStep::replay() {
  graph_->replay();
  const ParameterList& params = model_.parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (grads_[i].defined()) params[i].tensor.set_grad(grads_[i]);
  return loss_sum_;
}

// Reads the step's loss, gradient norms, MoE counts (settling them: the stats hold
// this step's counts after it, as after an eager step) and max logits.
GraphStep::Print GraphStep::print(const Tensor& loss_sum) {
  NoGradGuard no_grad;
  Print p;
  Tensors norms;
  const ParameterList& params = model_.parameters();
  for (const NamedParameter& q : params) {
    const Tensor g = q.tensor.grad();
    norms.push_back(g.defined() ? reshape(sum(square(g.to(DType::f64))), {1}) : full({1}, -1.0, DType::f64, device_));
  }
  norms.push_back(reshape(loss_sum.to(DType::f64), {1}));
  const Tensor host = concat(norms, 0).to(kCpu);
  const double* v = host.data<double>();
  p.grad_norms.assign(v, v + params.size());
  p.loss = v[params.size()];
  for (MoeLayer* m : model_.moe_layers()) {
    const MoeStats& s = m->stats();
    std::vector<double> counts = s.tokens_per_expert;
    counts.push_back(static_cast<double>(s.dropped));
    p.moe_counts.push_back(std::move(counts));
  }
  for (QkClipSite* site : model_.qk_clip_sites()) {
    std::vector<double> logits;
    if (site->max_logit.defined()) {
      const Tensor m = site->max_logit.detach().to(DType::f64).to(kCpu);
      logits.assign(m.data<double>(), m.data<double>() + m.numel());
    }
    p.max_logits.push_back(std::move(logits));
  }
  return p;
}

namespace {

// "" when the replay's print matches the eager one; else what differs first.
std::string compare(const std::string& input, const std::vector<double>& eager_norms, double eager_loss,
                    const std::vector<double>& graph_norms, double graph_loss, double* worst) {
  auto check = [&](double a, double b, const std::string& what) -> std::string {
    const double d = relative_difference(a, b);
    *worst = std::max(*worst, d);
    if (d <= kGraphCheckTolerance && (a < 0) == (b < 0)) return "";
    return fmt::format("{}: {} eagerly, {} replayed (relative difference {:.3g}, bound {:.0e})", what, a, b, d,
                       kGraphCheckTolerance);
  };
  if (std::string bad = check(eager_loss, graph_loss, input + ", the loss"); !bad.empty()) return bad;
  for (size_t i = 0; i < eager_norms.size(); ++i)
    if (std::string bad = check(eager_norms[i], graph_norms[i], fmt::format("{}, gradient {}'s squared norm", input, i));
        !bad.empty())
      return bad;
  return "";
}

}  // namespace

void GraphStep::give_up(const std::string& why) {
  graph_.reset();
  grads_.clear();
  loss_sum_ = Tensor();
  status_ = "not used: " + why;
  clear_step_state();
  if (mode_ == CudaGraphMode::on)
    throw Error(fmt::format("train.cuda_graph is on, but the step cannot be replayed from a CUDA graph: {}. "
                            "Set train.cuda_graph: auto (falls back to eager steps) or off (docs/cuda.md#cuda-graphs)",
                            why));
  spdlog::warn("train.cuda_graph auto: the step runs eagerly (one launch per kernel): {} (docs/cuda.md#cuda-graphs)",
               why);
}

namespace {

// The routers' biases moved for the rolled input, and back for the step's own
// (restored whatever happens): each replay below follows an eager step that left
// the other bias in the routers' device copies, so a replay that did not refresh
// the copy first (Router::bias_on's before-replay hook) would select other experts.
class ShiftedBiases {
 public:
  explicit ShiftedBiases(LanguageModel& model) {
    for (MoeLayer* m : model.moe_layers()) {
      routers_.push_back(&m->router.bias);
      saved_.push_back(m->router.bias.clone());
    }
  }
  ~ShiftedBiases() { restore(); }
  ShiftedBiases(const ShiftedBiases&) = delete;
  ShiftedBiases& operator=(const ShiftedBiases&) = delete;
  // b_e -+ 0.5 for even / odd e: enough to move sigmoid scores' top-k.
  void shift() {
    for (size_t i = 0; i < routers_.size(); ++i) {
      float* b = routers_[i]->data<float>();
      const float* b0 = saved_[i].data<float>();
      for (int64_t e = 0; e < routers_[i]->numel(); ++e) b[e] = b0[e] + (e % 2 ? 0.5f : -0.5f);
    }
  }
  void restore() {
    for (size_t i = 0; i < routers_.size(); ++i) copy_(*routers_[i], saved_[i]);
  }

 private:
  std::vector<Tensor*> routers_;
  std::vector<Tensor> saved_;
};

}  // namespace

// Capture, then replay against the eager step on the rolled batch and on the batch;
// true when the graph is kept (the step's result is then the last replay's).
bool GraphStep::capture_and_check(const std::vector<data::Batch>& batches) {
  std::vector<data::Batch> other;
  for (const data::Batch& b : batches) other.push_back(rolled(b));
  try {
    ShiftedBiases biases(model_);
    // The eager step on the rolled batch (routers shifted), through the static buffers.
    biases.shift();
    clear_step_state();
    upload(other);
    const Print eager_other = print(body_(ids_, targets_));
    // The capture: nothing runs.
    clear_step_state();
    Tensor captured;
    graph_ = std::make_unique<cuda::Graph>(device_.index, [&] { captured = body_(ids_, targets_); });
    loss_sum_ = captured;
    const ParameterList& params = model_.parameters();
    grads_.clear();
    for (const NamedParameter& p : params) grads_.push_back(p.tensor.grad());
    double worst = 0;
    // Eager on the step's own batch (biases as they are), replayed on the rolled one
    // (shifted), replayed on the own one (as they are): each replay follows an eager
    // step or a replay on the other input and bias. The last is the step's result.
    biases.restore();
    upload(batches);
    clear_step_state();
    const Print eager_own = print(body_(ids_, targets_));
    biases.shift();
    upload(other);
    clear_step_state();
    const Print graph_other = print(replay());
    biases.restore();
    upload(batches);
    clear_step_state();
    const Print graph_own = print(replay());
    std::string bad = compare("the rolled batch", eager_other.grad_norms, eager_other.loss, graph_other.grad_norms,
                              graph_other.loss, &worst);
    if (bad.empty())
      bad = compare("the batch", eager_own.grad_norms, eager_own.loss, graph_own.grad_norms, graph_own.loss, &worst);
    if (bad.empty() && (eager_other.moe_counts != graph_other.moe_counts || eager_own.moe_counts != graph_own.moe_counts))
      bad = "the MoE layers' expert counts differ between the eager step and the replay";
    auto compare_logits = [&](const char* input, const Print& eager_print, const Print& graph_print) {
      for (size_t i = 0; bad.empty() && i < eager_print.max_logits.size(); ++i) {
        const std::vector<double>&a = eager_print.max_logits[i], &b = graph_print.max_logits[i];
        if (a.size() != b.size())
          bad = fmt::format("{}, QK-Clip site {}: {} max logits eagerly, {} replayed", input, i, a.size(), b.size());
        for (size_t h = 0; bad.empty() && h < a.size(); ++h)
          if (relative_difference(a[h], b[h]) > kGraphCheckTolerance)
            bad = fmt::format("{}, QK-Clip site {} head {}: max logit {} eagerly, {} replayed", input, i, h, a[h],
                              b[h]);
      }
    };
    compare_logits("the rolled batch", eager_other, graph_other);
    compare_logits("the batch", eager_own, graph_own);
    if (!bad.empty()) {
      give_up("the replay differs from the eager step: " + bad);
      return false;
    }
    status_ = fmt::format("captured: {} nodes, a {} pool; replayed on two inputs, the largest relative difference "
                          "from the eager step {:.3g}",
                          with_commas(graph_->nodes()), human_bytes(static_cast<double>(graph_->pool_bytes())), worst);
    spdlog::info("train.cuda_graph: the forward and backward {}", status_);
    return true;
  } catch (const graph::CaptureRefused& e) {
    give_up(e.what());
  } catch (const OutOfMemoryError& e) {
    give_up(std::string("out of memory while capturing or checking: ") + e.what());
  }
  return false;
}

Tensor GraphStep::run(const std::vector<data::Batch>& batches, bool capture_now) {
  if (!graph_ && capture_now && !tried_) {
    tried_ = true;
    if (capture_and_check(batches)) return loss_sum_;
    upload(batches);
    return body_(ids_, targets_);
  }
  bool same_shapes = graph_ && batches.size() == ids_.size();
  for (size_t m = 0; same_shapes && m < batches.size(); ++m)
    same_shapes = batches[m].inputs.shape() == ids_[m].shape() && batches[m].inputs.dtype() == ids_[m].dtype() &&
                  batches[m].targets.shape() == targets_[m].shape() &&
                  batches[m].targets.dtype() == targets_[m].dtype();
  if (same_shapes) {
    upload(batches);
    return replay();
  }
  // Before the capture, after a fallback, or a batch of other shapes: eager, on the
  // host batch, as with train.cuda_graph off.
  std::vector<Tensor> ids, targets;
  for (const data::Batch& b : batches) {
    ids.push_back(b.inputs);
    targets.push_back(b.targets);
  }
  return body_(ids, targets);
}

}  // namespace moetrain
