// The trainer's settings, read once from the resolved config at the boundary
// (as HybridConfig::from does for the model): the loop reads typed fields, never
// config keys. Each struct's from() checks what only the trainer can check and
// names the key when it fails (ConfigError, exit 2).
#pragma once

#include <cstdint>
#include <string>

#include "config/config.h"
#include "data/synthetic.h"
#include "optim/make_optimizer.h"
#include "optim/schedule.h"
#include "train/sampling.h"

namespace moetrain {

// train.*: the step, the optimizer, evaluation, samples and logging.
struct TrainOptions {
  int64_t batch_size = 0, seq_len = 0, grad_accum = 1, max_steps = 0;
  uint64_t seed = 0;
  int64_t threads = 0;             // 0: the CLI's default (cores / ranks on this node)
  OptimizerOptions optimizer;      // train.optimizer and its rules' settings
  bool qk_clip = false;            // train.qk_clip
  double qk_clip_tau = 100;
  LrSchedule schedule;
  double grad_clip = 0;            // 0: no clipping
  bool decay_embeddings = false;
  bool abort_on_nan = false;       // train.nan_policy abort (else skip)
  bool check_update = true;        // skip a step whose update would not be finite
  int64_t max_consecutive_skips = 0;
  int64_t eval_every = 0, eval_batches = 0, sample_every = 0, log_every = 1;
  SamplingOptions sample;          // train.sample_tokens, _temperature, _top_k; seed = train.seed
  std::string sample_prompt;
  bool profile = false;
  bool cuda = false;               // train.device cuda
  bool mixed_precision = false;    // train.dtype bf16 (CPU or CUDA)
  bool tf32 = false;
  std::string cuda_graph = "auto"; // train.cuda_graph: auto | on | off

  static TrainOptions from(const Config& config);
  // Tokens of one optimizer step over `ranks` ranks.
  int64_t tokens_per_step(int ranks) const { return batch_size * seq_len * grad_accum * ranks; }
};

// data.*: token shards, or a synthetic memory task.
struct DataOptions {
  std::string train, val;          // shard patterns ("" when synthetic; val may be "")
  std::string tokenizer, tokenizer_dir;
  bool synthetic = false;
  data::SyntheticOptions task;     // when synthetic
  int64_t vocab_size = 0;          // model.vocab_size, which the data must fit

  static DataOptions from(const Config& config, const TrainOptions& train);
};

// ckpt.* and run.*: where the run lives and when it saves.
struct CheckpointOptions {
  std::string run_dir;
  bool overwrite = false;          // run.overwrite
  int64_t every = 0, keep_last = 3;
  bool async = false;
  std::string resume;              // none | auto | step_XXXXXXXX

  static CheckpointOptions from(const Config& config);
  bool resume_none() const { return resume.empty() || resume == "none"; }
};

// The learning-rate schedule of a config (train.schedule, lr, min_lr, warmup_steps,
// max_steps, wsd_decay_frac), without TrainOptions' other checks.
LrSchedule lr_schedule_of(const Config& config);

}  // namespace moetrain
