// The training loop of `moetrain train` (docs/training.md; the structure in
// docs/architecture.md, "The trainer").
//
// A Trainer is one run's lifecycle, read top to bottom by train():
//   Trainer(config)  options read once, the process grid, the run directory's
//                    lock, data (token shards or a synthetic memory task), the
//                    model, the optimizer (train.optimizer) and its schedule, the fault plan
//   resume()         the checkpoint ckpt.resume names (if any) loaded, the device
//                    placement, then the start made durable in the run directory
//   train_step()     one optimizer step: the micro-batches through the model
//                    (gradient accumulation), the gradient reduction across ranks
//                    and clipping, then the update, or a skip when the loss, the
//                    gradients or the update would not be finite
//   evaluate(), sample(), save()   every N steps
//   finish()         after the last step: the model written to <run>/model
//   stop()           after a stop signal: a checkpoint, and the exit code
// Signals (core/signals.h) noted before step 1 end the run at the next safe point
// of the constructor or resume() with Interrupted, nothing written.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "core/launch_count.h"
#include "core/signals.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "nn/ledger.h"
#include "optim/make_optimizer.h"
#include "train/qk_clip_step.h"
#include "train/distributed.h"
#include "train/fault.h"
#include "train/graph_step.h"
#include "train/metrics.h"
#include "train/options.h"
#include "train/run_dir.h"

namespace moetrain {

struct TrainSummary {
  int64_t steps = 0;
  double last_train_loss = 0;
  double last_val_loss = -1;  // -1: no validation data
  double last_val_acc = -1;   // data.synthetic: answer accuracy of the last evaluation; -1 otherwise
  double tokens_per_second = 0;
  int exit_code = 0;          // 0, or kExitPreempted after SIGTERM/SIGINT/SIGHUP/SIGUSR2
};

// The MoE layers' load after a step: metrics fields and the worst figures.
struct MoeStepSummary {
  std::vector<std::pair<std::string, MetricsWriter::Value>> fields;
  double worst_max_over_mean = 0;
  int64_t dead = 0, dropped = 0;
};

// One optimizer step.
struct StepResult {
  int64_t step = 0;           // 1-based: the steps done after this one
  double loss = 0;            // mean over the ranks' micro-batches
  double grad_norm = 0;       // before clipping
  double lr = 0;
  bool skipped = false;       // no update: see skip_reason
  std::string skip_reason;
  int64_t tokens = 0;         // trained on in this step, all ranks
  double seconds = 0;         // wall time of the step on this rank
  MoeStepSummary moe;
  QkClipSummary qk;           // train.qk_clip
};

struct EvalResult {
  double loss = -1;           // -1: no validation data
  double accuracy = -1;       // synthetic tasks: answer accuracy
  int64_t answers = 0;
};

class Trainer {
 public:
  explicit Trainer(const Config& config);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void resume();
  bool done() const { return progress_.step >= train_.max_steps; }
  int64_t step() const { return progress_.step; }

  StepResult train_step();
  // The console line and the metrics record of a step.
  void record(const StepResult& r);
  EvalResult evaluate();
  void sample();
  void save();
  // With ckpt.async: commits a background save once every rank has written its file. Collective.
  void poll_saves();
  bool eval_due() const { return due(train_.eval_every) || (train_.eval_every > 0 && done()); }
  bool sample_due() const { return due(train_.sample_every) && !done(); }
  bool checkpoint_due() const { return due(ckpt_.every) || (ckpt_.every > 0 && done()); }
  // Collective: the strongest stop any rank has been asked for (signals).
  signals::Stop stop_requested();

  TrainSummary stop(signals::Stop stop);
  TrainSummary finish();

  LanguageModel& model() { return *model_; }
  const Optimizer& optimizer() const { return *opt_; }
  const TrainProgress& progress() const { return progress_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Stream;  // the training batches: shards or a synthetic task

  void check_config_changes(const std::string& checkpoint_dir, int64_t step);

  bool due(int64_t every) const { return every > 0 && progress_.step > 0 && progress_.step % every == 0; }
  void open_data();
  void build();
  void place_on_device();
  void begin_run(const StartPlan& plan);
  data::Batch next_batch();
  double forward_backward(int64_t step);
  // The forward and backward of the micro-batches (host or device tensors), gradients
  // accumulated; returns the summed loss, an f64 scalar where the model is, unread.
  // `overlap`: the last micro-batch's backward starts the gradient sums (train.overlap_grad_sync).
  Tensor micro_batches(const std::vector<Tensor>& ids, const std::vector<Tensor>& targets, int64_t step, bool overlap);
  void setup_cuda_graph();
  // What a pipeline stage sends and receives: bf16 under mixed precision (the model reports f32).
  DType activation_dtype() const;
  // What evaluation and samples run: the model, or under pp the pipelined view of it.
  LanguageModel& whole_model() { return whole_model_ ? *whole_model_ : *model_; }
  double reduce_gradients();
  StepResult skip(StepResult r, std::string why);
  std::optional<std::string> update_problem(double lr);
  MoeStepSummary update(double lr, QkClipSummary& qk);
  void end_step(StepResult& r, Clock::time_point t0);
  void log_saved(const std::optional<SaveResult>& saved);
  void report_start() const;
  void report_end();
  TrainSummary summary() const;

  const Config config_;  // a copy: the saver and the checkpoints refer to it
  TrainOptions train_;
  DataOptions data_;
  CheckpointOptions ckpt_;
  Distributed dist_;
  FaultPlan faults_;
  std::unique_ptr<RunDirectory> run_;  // the root rank's
  std::unique_ptr<data::Tokenizer> tokenizer_;  // none for a synthetic task (its ids are not text)
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<data::DataLoader> val_loader_;
  double baseline_rss_ = 0;
  std::optional<Ledger> ledger_;
  std::unique_ptr<LanguageModel> model_;        // under pp: this rank's stage
  std::unique_ptr<LanguageModel> whole_model_;  // under pp: train/pipeline.h's pipelined view of model_
  std::unique_ptr<Optimizer> opt_;
  Device device_ = kCpu;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<CheckpointSaver> saver_;
  SaveOptions save_options_;
  TrainProgress progress_;
  int64_t start_step_ = 0, start_tokens_ = 0, profiled_steps_ = 0;
  // train.profile: the launch counter (core/launch_count.h) at the profiled step's
  // start, and the launches of the profiled steps so far.
  LaunchCounts step_launches_from_, profiled_launches_;
  double model_flops_per_token_ = 0;  // training FLOPs (forward + backward) at train.seq_len
  double peak_flops_ = 0;             // per rank: train.peak_tflops, or measured at the start
  double step_seconds_avg_ = 0;       // the step line's smoothed step time
  int64_t last_saved_step_ = -1;
  // A step of the current streak of skipped steps had a non-finite loss: the model
  // as it stands computes NaN or infinities (finish() then writes no model).
  bool streak_loss_non_finite_ = false;
  StepResult last_;
  EvalResult last_eval_;
  Clock::time_point run_start_;
  // train.cuda_graph on one GPU (last: its replay hooks refer to the model).
  std::unique_ptr<GraphStep> graph_step_;
};

// The whole run: the loop over Trainer's steps.
TrainSummary train(const Config& config);

}  // namespace moetrain
