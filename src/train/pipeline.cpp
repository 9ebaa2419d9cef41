// The 1F1B schedule and the pipelined whole-model view (train/pipeline.h;
// docs/parallelism.md#pipeline-parallelism).
#include "train/pipeline.h"

#include <deque>
#include <map>
#include <memory>

#include "autograd/engine.h"
#include "comm/watchdog.h"
#include "core/grad_mode.h"
#include "core/profile.h"
#include "nn/pipeline_schedule.h"
#include "ops/elementwise/elementwise.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

using comm::P2POp;

// What a chunk receives for one micro-batch: stage_input_count(chunk) tensors [B, T, D].
Tensors empty_inputs(const LanguageModel& stage, int64_t chunk, int64_t B, int64_t T, DType dtype, Device device) {
  Tensors out;
  for (int64_t i = 0; i < stage.stage_input_count(chunk); ++i)
    out.push_back(empty({B, T, stage.hidden_size()}, dtype, device));
  return out;
}

Tensors empty_like_all(const Tensors& ts) {
  Tensors out;
  for (const Tensor& t : ts) out.push_back(empty(t.shape(), t.dtype(), t.device()));
  return out;
}

// One send_recv over the pipeline group (ops may be empty: nothing to do).
void exchange(Distributed& d, const char* what, std::vector<P2POp> ops) {
  if (ops.empty()) return;
  comm::WatchdogLabel label(what);
  profile::Region region("pipeline p2p");
  d.grid.pipe_group->send_recv(ops);
}

void append(std::vector<P2POp>& ops, P2POp::Kind kind, int peer, const Tensors& ts) {
  for (const Tensor& t : ts) ops.push_back({kind, peer, kind == P2POp::Kind::send ? t.detach() : t});
}

// Runs this rank's ticks of the step's timeline (nn/pipeline_schedule.h): in each,
// its action (a chunk's forward or backward of one micro-batch), then the messages
// of the tick, started in one start_send_recv, which its peers post in the same tick.
class Schedule {
 public:
  Schedule(Distributed& d, LanguageModel& stage, const std::vector<data::Batch>& batches, Device device,
           DType activations)
      : d_(d), stage_(stage), batches_(batches), device_(device), activations_(activations),
        where_(stage.pipeline_stage()),
        scale_(1.0 / static_cast<double>(batches.size())) {}

  // Each tick's messages are started (Communicator::start_send_recv) and not waited
  // for: the rank goes on to its next action and waits only for a receive that
  // action consumes, so a forward is not held back by a neighbour's longer
  // backward (the ticks order the work; they are not time). Sends finish in the
  // background, their buffers kept by the handles; all end before the step returns.
  PipelineStepResult run() {
    const int64_t M = static_cast<int64_t>(batches_.size());
    const PipelineTimeline timeline = pipeline_timeline(where_.count, where_.chunks, M);
    for (const PipelineTick& tick : timeline.ranks[static_cast<size_t>(where_.index)]) {
      Tensors made;  // what this tick's action sends on
      if (tick.has_action) {
        const PipelineAction& a = tick.action;
        const bool forward_pass = a.kind == PipelineAction::Kind::forward;
        if (forward_pass ? !first_virtual(a.chunk) : !last_virtual(a.chunk)) arrival({a.micro, a.chunk}, !forward_pass);
        made = forward_pass ? forward(a) : backward(a);
      }
      std::vector<P2POp> ops;
      for (const PipelineMessage& m : tick.sends) append(ops, P2POp::Kind::send, m.peer, made);
      std::vector<std::pair<Key, bool>> arriving;
      for (const PipelineMessage& m : tick.recvs) {
        const Key k{m.micro, m.chunk};
        Tensors& box = m.gradient ? grads_[k] : inputs_[k];
        box = m.gradient ? empty_like_all(flight_.at(k).out.activations)
                         : empty_inputs(stage_, m.chunk, batch_rows(), batch_cols(), activations_, device_);
        append(ops, P2POp::Kind::recv, m.peer, box);
        arriving.emplace_back(k, m.gradient);
      }
      if (ops.empty()) continue;
      std::shared_ptr<comm::PendingCollective> pending;
      {
        profile::Region region("pipeline p2p");
        pending = d_.grid.pipe_group->start_send_recv(std::move(ops));
      }
      for (const auto& [k, gradient] : arriving) (gradient ? grad_arrivals_ : input_arrivals_)[k] = pending;
      in_transit_.push_back(std::move(pending));
      // Let MPI move what is under way, and drop the handles that are done.
      while (!in_transit_.empty() && in_transit_.front()->test()) in_transit_.pop_front();
    }
    {
      comm::WatchdogLabel label("pipeline: the step's last sends");
      profile::Region region("pipeline p2p");
      for (const auto& p : in_transit_) p->wait();
      in_transit_.clear();
    }
    MT_ASSERT(flight_.empty() && inputs_.empty() && grads_.empty() && input_arrivals_.empty() &&
                  grad_arrivals_.empty(),
              "pipeline schedule: {} micro-batches in flight, {} inputs and {} gradients unused after the step",
              flight_.size(), inputs_.size(), grads_.size());
    return result_;
  }

 private:
  using Key = std::pair<int64_t, int64_t>;  // (micro-batch, chunk)
  struct InFlight {
    Tensors inputs;  // leaves: their grads go back to the previous virtual stage
    StageOutput out;
  };

  // Waits until the input (gradient: the output gradient) of (micro-batch, chunk) has arrived.
  void arrival(const Key& k, bool gradient) {
    auto& arrivals = gradient ? grad_arrivals_ : input_arrivals_;
    auto it = arrivals.find(k);
    MT_ASSERT(it != arrivals.end(), "pipeline: micro-batch {} chunk {} needs its {} before it was posted", k.first,
              k.second, gradient ? "gradient" : "input");
    comm::WatchdogLabel label(gradient ? "pipeline: receive gradients" : "pipeline: receive activations");
    profile::Region region("pipeline p2p");
    it->second->wait();
    arrivals.erase(it);
  }

  int64_t batch_rows() const { return batches_.front().inputs.size(0); }
  int64_t batch_cols() const { return batches_.front().inputs.size(1); }
  bool first_virtual(int64_t chunk) const { return where_.virtual_index(chunk) == 0; }
  bool last_virtual(int64_t chunk) const { return where_.virtual_index(chunk) == where_.virtual_count() - 1; }

  // A chunk's forward of one micro-batch; returns what goes to the next virtual stage.
  Tensors forward(const PipelineAction& a) {
    const data::Batch& b = batches_[static_cast<size_t>(a.micro)];
    const Key k{a.micro, a.chunk};
    Tensors inputs;
    if (!first_virtual(a.chunk)) {
      auto it = inputs_.find(k);
      MT_ASSERT(it != inputs_.end(), "pipeline: micro-batch {} chunk {} runs before its input arrived", a.micro,
                a.chunk);
      inputs = std::move(it->second);
      inputs_.erase(it);
    }
    for (Tensor& t : inputs) t.set_requires_grad(true);
    // Host batches: the embedding and the loss move them (docs/cuda.md, "Host synchronisation").
    const Tensor ids = first_virtual(a.chunk) ? b.inputs : Tensor();
    const Tensor targets = last_virtual(a.chunk) ? b.targets : Tensor();
    StageOutput out = stage_.stage_forward(ids, inputs, targets, true, a.chunk);
    if (last_virtual(a.chunk)) result_.loss_sum += out.loss.item<double>();
    Tensors sent = out.activations;
    flight_.emplace(k, InFlight{std::move(inputs), std::move(out)});
    result_.max_in_flight = std::max(result_.max_in_flight, static_cast<int64_t>(flight_.size()));
    return sent;
  }

  // A chunk's backward of one micro-batch, given the gradients of its outputs
  // (received; none on the last virtual stage); returns its inputs' gradients.
  Tensors backward(const PipelineAction& a) {
    const Key k{a.micro, a.chunk};
    auto fit = flight_.find(k);
    MT_ASSERT(fit != flight_.end(), "pipeline: backward of micro-batch {} chunk {} before its forward", a.micro,
              a.chunk);
    InFlight f = std::move(fit->second);
    flight_.erase(fit);
    Tensors output_grads;
    if (!last_virtual(a.chunk)) {
      auto git = grads_.find(k);
      MT_ASSERT(git != grads_.end(), "pipeline: backward of micro-batch {} chunk {} before its gradients arrived",
                a.micro, a.chunk);
      output_grads = std::move(git->second);
      grads_.erase(git);
    }
    Tensors roots, grads;
    if (f.out.loss.defined()) {  // the loss (last stage) or the chunk's aux losses, scaled for accumulation
      roots.push_back(mul_scalar(f.out.loss, scale_));
      grads.emplace_back();
    }
    MT_ASSERT(output_grads.size() == f.out.activations.size(), "pipeline: {} output gradients for {} outputs",
              output_grads.size(), f.out.activations.size());
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
  DType activations_;
  PipelineStage where_;
  double scale_;
  std::map<Key, InFlight> flight_;
  std::map<Key, Tensors> inputs_, grads_;  // received (or being received), not yet consumed
  // The started send_recv that fills each of them, and every one not known done yet.
  std::map<Key, std::shared_ptr<comm::PendingCollective>> input_arrivals_, grad_arrivals_;
  std::deque<std::shared_ptr<comm::PendingCollective>> in_transit_;
  PipelineStepResult result_;
};

// The whole model from one stage (pipelined_model).
class PipelinedModel final : public LanguageModel {
 public:
  PipelinedModel(Distributed& d, LanguageModel& stage, DType activations)
      : d_(d), stage_(stage), activations_(activations) {}

  std::string arch() const override { return stage_.arch(); }
  std::string describe() const override { return stage_.describe(); }
  int64_t vocab_size() const override { return stage_.vocab_size(); }
  int64_t max_positions() const override { return stage_.max_positions(); }
  DType dtype() const override { return stage_.dtype(); }
  int64_t hidden_size() const override { return stage_.hidden_size(); }

  // Every virtual stage in turn: this rank runs its chunks, receiving each one's
  // input from the rank before it (the last rank for chunk c > 0 on rank 0).
  Tensor forward(const Tensor& ids, bool training) override {
    NoGradGuard no_grad;
    MT_CHECK(ids.dim() == 2, "pipelined model: ids must be [B, T], got {}", ids.shape());
    const int64_t B = ids.size(0), T = ids.size(1);
    const Device device = stage_.parameters().front().tensor.device();
    const PipelineStage where = stage_.pipeline_stage();
    const int pp = static_cast<int>(where.count);
    const int prev = (d_.grid.pp_index + pp - 1) % pp, next = (d_.grid.pp_index + 1) % pp;
    StageOutput out;
    for (int64_t c = 0; c < where.chunks; ++c) {
      const int64_t g = where.virtual_index(c);
      Tensors in = g > 0 ? empty_inputs(stage_, c, B, T, activations_, device) : Tensors{};
      std::vector<P2POp> ops;
      append(ops, P2POp::Kind::recv, prev, in);
      exchange(d_, "pipeline (eval): receive activations", std::move(ops));
      out = stage_.stage_forward(ids.to(device), in, Tensor(), training, c);
      ops.clear();
      if (g < where.virtual_count() - 1) append(ops, P2POp::Kind::send, next, out.activations);
      exchange(d_, "pipeline (eval): send activations", std::move(ops));
    }
    Tensor logits = d_.grid.last_stage() ? out.logits : empty({B, T, vocab_size()}, activations_, device);
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
  DType activations_;
};

}  // namespace

PipelineStepResult pipeline_train_step(Distributed& d, LanguageModel& stage, const std::vector<data::Batch>& batches,
                                       Device device, std::optional<DType> activations) {
  MT_CHECK(d.grid.pp > 1 && d.grid.pipe_group, "pipeline_train_step: this run has no pipeline (train.pp = 1)");
  MT_CHECK(!batches.empty(), "pipeline_train_step: no micro-batches");
  MT_CHECK(stage.pipeline_stage().index == d.grid.pp_index && stage.pipeline_stage().count == d.grid.pp,
           "pipeline_train_step: the model is stage {} of {}, this rank is stage {} of {}", stage.pipeline_stage().index,
           stage.pipeline_stage().count, d.grid.pp_index, d.grid.pp);
  return Schedule(d, stage, batches, device, activations.value_or(stage.dtype())).run();
}

std::unique_ptr<LanguageModel> pipelined_model(Distributed& d, LanguageModel& stage,
                                               std::optional<DType> activations) {
  MT_CHECK(d.grid.pp > 1 && d.grid.pipe_group, "pipelined_model: this run has no pipeline (train.pp = 1)");
  return std::make_unique<PipelinedModel>(d, stage, activations.value_or(stage.dtype()));
}

}  // namespace moetrain
