// The 1F1B schedule and the pipelined whole-model view (train/pipeline.h;
// docs/parallelism.md#pipeline-parallelism).
#include "train/pipeline.h"

#include <deque>

#include "autograd/engine.h"
#include "comm/watchdog.h"
#include "core/grad_mode.h"
#include "core/profile.h"
#include "ops/elementwise/elementwise.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

using comm::P2POp;

// The neighbours of this rank in its pipeline (ranks of pipe_group), -1 at the ends.
struct Neighbours {
  int prev = -1, next = -1;
  explicit Neighbours(const Distributed& d) {
    if (!d.grid.first_stage()) prev = d.grid.pp_index - 1;
    if (!d.grid.last_stage()) next = d.grid.pp_index + 1;
  }
};

// What this stage receives for one micro-batch: stage_input_count() tensors [B, T, D].
Tensors empty_inputs(const LanguageModel& stage, int64_t B, int64_t T, Device device) {
  Tensors out;
  for (int64_t i = 0; i < stage.stage_input_count(); ++i)
    out.push_back(empty({B, T, stage.hidden_size()}, stage.dtype(), device));
  return out;
}

Tensors empty_like_all(const Tensors& ts) {
  Tensors out;
  for (const Tensor& t : ts) out.push_back(empty(t.shape(), t.dtype(), t.device()));
  return out;
}

// One send_recv over the pipeline group: `sends` to `to`, `recvs` from `from`
// (either list may be empty, a peer of -1 means none).
void exchange(Distributed& d, const char* what, int to, const Tensors& sends, int from, const Tensors& recvs) {
  std::vector<P2POp> ops;
  if (to >= 0)
    for (const Tensor& t : sends) ops.push_back({P2POp::Kind::send, to, t.detach()});
  if (from >= 0)
    for (const Tensor& t : recvs) ops.push_back({P2POp::Kind::recv, from, t});
  if (ops.empty()) return;
  comm::WatchdogLabel label(what);
  profile::Region region("pipeline p2p");
  d.grid.pipe_group->send_recv(ops);
}

class Schedule {
 public:
  Schedule(Distributed& d, LanguageModel& stage, const std::vector<data::Batch>& batches, Device device)
      : d_(d), stage_(stage), batches_(batches), device_(device), peers_(d),
        scale_(1.0 / static_cast<double>(batches.size())) {}

  PipelineStepResult run() {
    const int64_t M = static_cast<int64_t>(batches_.size());
    const int64_t warmup = std::min<int64_t>(d_.grid.pp - d_.grid.pp_index - 1, M), steady = M - warmup;
    for (int64_t i = 0; i < warmup; ++i) {
      Tensors in = receive_inputs();
      exchange(d_, "pipeline: send activations", peers_.next, forward(std::move(in)), -1, {});
    }
    Tensors in;
    if (steady > 0) in = receive_inputs();
    for (int64_t j = 0; j < steady; ++j) {
      Tensors out = forward(std::move(in));
      // Send this forward's output while receiving the gradient of the oldest one in flight.
      Tensors grads = peers_.next >= 0 ? empty_like_all(flight_.front().out.activations) : Tensors{};
      exchange(d_, "pipeline: send activations, receive gradients", peers_.next, out, peers_.next, grads);
      Tensors input_grads = backward(grads);
      if (j == steady - 1) {
        exchange(d_, "pipeline: send gradients", peers_.prev, input_grads, -1, {});
      } else {
        in = peers_.prev >= 0 ? empty_inputs(stage_, batch_rows(), batch_cols(), device_) : Tensors{};
        exchange(d_, "pipeline: send gradients, receive activations", peers_.prev, input_grads, peers_.prev, in);
      }
    }
    for (int64_t i = 0; i < warmup; ++i) {
      Tensors grads = peers_.next >= 0 ? empty_like_all(flight_.front().out.activations) : Tensors{};
      exchange(d_, "pipeline: receive gradients", -1, {}, peers_.next, grads);
      exchange(d_, "pipeline: send gradients", peers_.prev, backward(grads), -1, {});
    }
    MT_ASSERT(flight_.empty() && next_forward_ == M, "pipeline schedule: {} micro-batches in flight after the step",
              flight_.size());
    return result_;
  }

 private:
  struct InFlight {
    Tensors inputs;  // leaves: their grads go back to the previous stage
    StageOutput out;
  };

  int64_t batch_rows() const { return batches_.front().inputs.size(0); }
  int64_t batch_cols() const { return batches_.front().inputs.size(1); }

  Tensors receive_inputs() {
    if (peers_.prev < 0) return {};
    Tensors in = empty_inputs(stage_, batch_rows(), batch_cols(), device_);
    exchange(d_, "pipeline: receive activations", -1, {}, peers_.prev, in);
    return in;
  }

  Tensors forward(Tensors inputs) {
    const data::Batch& b = batches_[static_cast<size_t>(next_forward_++)];
    for (Tensor& t : inputs) t.set_requires_grad(true);
    const PipelineStage s = stage_.pipeline_stage();
    // Host batches: the embedding and the loss move them (docs/cuda.md, "Host synchronisation").
    const Tensor ids = s.first() ? b.inputs : Tensor();
    const Tensor targets = s.last() ? b.targets : Tensor();
    StageOutput out = stage_.stage_forward(ids, inputs, targets, true);
    if (s.last()) result_.loss_sum += out.loss.item<double>();
    flight_.push_back({std::move(inputs), std::move(out)});
    result_.max_in_flight = std::max(result_.max_in_flight, static_cast<int64_t>(flight_.size()));
    return flight_.back().out.activations;
  }

  // Backward of the oldest micro-batch in flight, given the gradients of its
  // outputs (none on the last stage); returns the gradients of its inputs.
  Tensors backward(const Tensors& output_grads) {
    InFlight f = std::move(flight_.front());
    flight_.pop_front();
    Tensors roots, grads;
    if (f.out.loss.defined()) {  // the loss (last stage) or the stage's aux losses, scaled for accumulation
      roots.push_back(mul_scalar(f.out.loss, scale_));
      grads.emplace_back();
    }
    MT_ASSERT(output_grads.size() == (stage_.pipeline_stage().last() ? 0 : f.out.activations.size()),
              "pipeline: {} output gradients for {} outputs", output_grads.size(), f.out.activations.size());
    for (size_t i = 0; i < output_grads.size(); ++i) {
      roots.push_back(f.out.activations[i]);
      grads.push_back(output_grads[i]);
    }
    autograd::backward(roots, grads);
    Tensors input_grads;
    for (const Tensor& in : f.inputs) {
      const Tensor g = in.grad();
      input_grads.push_back(g.defined() ? g : zeros(in.shape(), in.dtype(), in.device()));
    }
    return input_grads;
  }

  Distributed& d_;
  LanguageModel& stage_;
  const std::vector<data::Batch>& batches_;
  Device device_;
  Neighbours peers_;
  double scale_;
  int64_t next_forward_ = 0;
  std::deque<InFlight> flight_;
  PipelineStepResult result_;
};

// The whole model from one stage (pipelined_model).
class PipelinedModel final : public LanguageModel {
 public:
  PipelinedModel(Distributed& d, LanguageModel& stage) : d_(d), stage_(stage), peers_(d) {}

  std::string arch() const override { return stage_.arch(); }
  std::string describe() const override { return stage_.describe(); }
  int64_t vocab_size() const override { return stage_.vocab_size(); }
  int64_t max_positions() const override { return stage_.max_positions(); }
  DType dtype() const override { return stage_.dtype(); }
  int64_t hidden_size() const override { return stage_.hidden_size(); }

  Tensor forward(const Tensor& ids, bool training) override {
    NoGradGuard no_grad;
    MT_CHECK(ids.dim() == 2, "pipelined model: ids must be [B, T], got {}", ids.shape());
    const int64_t B = ids.size(0), T = ids.size(1);
    const Device device = stage_.parameters().front().tensor.device();
    Tensors in = peers_.prev >= 0 ? empty_inputs(stage_, B, T, device) : Tensors{};
    exchange(d_, "pipeline (eval): receive activations", -1, {}, peers_.prev, in);
    StageOutput out = stage_.stage_forward(ids.to(device), in, Tensor(), training);
    exchange(d_, "pipeline (eval): send activations", peers_.next, out.activations, -1, {});
    Tensor logits = d_.grid.last_stage() ? out.logits : empty({B, T, vocab_size()}, stage_.dtype(), device);
    comm::WatchdogLabel label("pipeline (eval): logits from the last stage");
    d_.grid.pipe_group->broadcast(logits, d_.grid.pp - 1);
    return logits;
  }

  std::unique_ptr<DecodeCache> new_cache() const override { return std::make_unique<PrefixCache>(); }
  Tensor forward_cached(const Tensor& ids, DecodeCache& cache) override {
    auto& c = dynamic_cast<PrefixCache&>(cache);
    c.ids = c.ids.defined() ? concat({c.ids, ids}, 1) : ids;
    const Tensor logits = forward(c.ids, false);
    return slice(logits, 1, c.ids.size(1) - ids.size(1), c.ids.size(1)).contiguous();
  }

  ParameterList& parameters() override { return stage_.parameters(); }
  ParameterList buffers() const override { return stage_.buffers(); }
  std::vector<MoeLayer*> moe_layers() const override { return stage_.moe_layers(); }
  double flops_per_token(int64_t seq_len) const override { return stage_.flops_per_token(seq_len); }
  double activation_bytes_per_token(bool mixed_precision) const override {
    return stage_.activation_bytes_per_token(mixed_precision);
  }
  int64_t decode_cache_bytes(int64_t length) const override { return stage_.decode_cache_bytes(length); }

 private:
  // The ids so far: each decoding call runs the whole prefix again.
  struct PrefixCache : DecodeCache {
    Tensor ids;
    int64_t length() const override { return ids.defined() ? ids.size(1) : 0; }
    int64_t bytes() const override { return ids.defined() ? ids.nbytes() : 0; }
  };

  Distributed& d_;
  LanguageModel& stage_;
  Neighbours peers_;
};

}  // namespace

PipelineStepResult pipeline_train_step(Distributed& d, LanguageModel& stage, const std::vector<data::Batch>& batches,
                                       Device device) {
  MT_CHECK(d.grid.pp > 1 && d.grid.pipe_group, "pipeline_train_step: this run has no pipeline (train.pp = 1)");
  MT_CHECK(!batches.empty(), "pipeline_train_step: no micro-batches");
  MT_CHECK(stage.pipeline_stage().index == d.grid.pp_index && stage.pipeline_stage().count == d.grid.pp,
           "pipeline_train_step: the model is stage {} of {}, this rank is stage {} of {}", stage.pipeline_stage().index,
           stage.pipeline_stage().count, d.grid.pp_index, d.grid.pp);
  return Schedule(d, stage, batches, device).run();
}

std::unique_ptr<LanguageModel> pipelined_model(Distributed& d, LanguageModel& stage) {
  MT_CHECK(d.grid.pp > 1 && d.grid.pipe_group, "pipelined_model: this run has no pipeline (train.pp = 1)");
  return std::make_unique<PipelinedModel>(d, stage);
}

}  // namespace moetrain
