#include "train/options.h"

#include <regex>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace moetrain {

LrSchedule lr_schedule_of(const Config& config) {
  return {parse_schedule(config.get_string("train.schedule")), config.get_number("train.lr"),
          config.get_number("train.min_lr"), config.get_int("train.warmup_steps"), config.get_int("train.max_steps"),
          config.get_number("train.wsd_decay_frac")};
}

TrainOptions TrainOptions::from(const Config& config) {
  TrainOptions o;
  o.batch_size = config.get_int("train.batch_size");
  o.seq_len = config.get_int("train.seq_len");
  o.grad_accum = config.get_int("train.grad_accum");
  o.max_steps = config.get_int("train.max_steps");
  o.seed = static_cast<uint64_t>(config.get_int("train.seed"));
  o.threads = config.get_int("train.threads");
  o.optimizer.kind = config.get_string("train.optimizer");
  o.optimizer.adamw = {config.get_number("train.beta1"), config.get_number("train.beta2"),
                       config.get_number("train.eps"), config.get_number("train.weight_decay")};
  o.optimizer.muon = {.momentum = config.get_number("train.muon_momentum"),
                      .nesterov = config.get_bool("train.muon_nesterov"),
                      .ns_steps = config.get_int("train.muon_ns_steps"),
                      .weight_decay = config.get_number("train.weight_decay"),
                      .eps = config.get_number("train.muon_eps")};
  o.qk_clip = config.get_bool("train.qk_clip");
  o.qk_clip_tau = config.get_number("train.qk_clip_tau");
  o.schedule = lr_schedule_of(config);
  // A config whose warmup outlasts the run never reaches train.lr: an error when the
  // config sets both. When --set shortened the run (a smoke test of a real config),
  // or the warmup is the schema's default, a warning instead.
  if (o.max_steps > 0 && o.schedule.warmup_steps > o.max_steps) {
    const std::string what = fmt::format("= {} exceeds train.max_steps = {}: the learning rate would never reach "
                                         "train.lr", o.schedule.warmup_steps, o.max_steps);
    if (config.is_set_explicitly("train.warmup_steps") && config.where("train.max_steps").rfind("--set", 0) != 0)
      config.fail("train.warmup_steps", what + "; lower train.warmup_steps or raise train.max_steps");
    spdlog::warn("{}: train.warmup_steps {} ({}); the run ends during the warmup", config.where("train.warmup_steps"),
                 what, config.where("train.max_steps"));
  }
  o.grad_clip = config.get_number("train.grad_clip");
  o.decay_embeddings = config.get_bool("train.decay_embeddings");
  o.abort_on_nan = config.get_string("train.nan_policy") == "abort";
  o.check_update = config.get_bool("train.check_update");
  o.max_consecutive_skips = config.get_int("train.max_consecutive_skips");
  o.eval_every = config.get_int("train.eval_every");
  o.eval_batches = config.get_int("train.eval_batches");
  o.sample_every = config.get_int("train.sample_every");
  o.log_every = config.get_int("train.log_every");
  o.sample.max_new_tokens = config.get_int("train.sample_tokens");
  o.sample.temperature = config.get_number("train.sample_temperature");
  o.sample.top_k = config.get_int("train.sample_top_k");
  o.sample.seed = o.seed;
  o.sample_prompt = config.get_string("train.sample_prompt");
  o.profile = config.get_bool("train.profile");
  o.cuda = config.get_string("train.device") == "cuda";
  o.mixed_precision = config.get_string("train.dtype") == "bf16";
  o.tf32 = config.get_bool("train.tf32");
  o.cuda_graph = config.get_string("train.cuda_graph");
  // What rules a graph out before anything starts (several ranks: Trainer::setup_cuda_graph).
  if (o.cuda_graph == "on" && !o.cuda)
    config.fail("train.cuda_graph", "captures on one GPU only, but train.device is cpu; set it to auto or off");
  if (o.cuda_graph == "on" && o.profile)
    config.fail("train.cuda_graph", "cannot be used with train.profile (which times each component eagerly); set "
                                    "train.cuda_graph to auto or off, or train.profile to false");
  // Mixed precision runs on either device: on the CPU the matrix products go through
  // oneDNN's bf16 matmul, the other kernels widen bf16 to f32 (docs/cuda.md, bf16 on the CPU).
  return o;
}

namespace {

// The synthetic memory task of data.synthetic (errors name the key).
data::SyntheticOptions synthetic_options(const Config& config) {
  data::SyntheticOptions o;
  try {
    o.task = data::parse_synthetic_task(config.get_string("data.synthetic"));
  } catch (const Error& e) {
    config.fail("data.synthetic", e.what());
  }
  o.num_keys = config.get_int("data.synthetic_num_keys");
  o.num_values = config.get_int("data.synthetic_num_values");
  o.num_pairs = config.get_int("data.synthetic_num_pairs");
  o.num_queries = config.get_int("data.synthetic_num_queries");
  o.num_rebinds = config.get_int("data.synthetic_num_rebinds");
  try {
    o.validate();
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    config.fail("data.synthetic", e.what());
  }
  return o;
}

}  // namespace

DataOptions DataOptions::from(const Config& config, const TrainOptions& train) {
  DataOptions o;
  o.vocab_size = config.get_int("model.vocab_size");
  o.synthetic = config.get_string("data.synthetic") != "none";
  o.tokenizer = config.get_string("data.tokenizer");
  o.tokenizer_dir = config.get_string("data.tokenizer_dir");
  if (!o.synthetic) {
    o.train = config.get_string("data.train");
    o.val = config.get_string("data.val");
    MT_CHECK(!o.train.empty(), "{}: data.train is empty; set it to the training shards, e.g. "
             "data/shakespeare/train_*.bin (made by `moetrain prepare`)", config.where("data.train"));
    return o;
  }
  o.task = synthetic_options(config);
  if (o.vocab_size < o.task.vocab_size())
    config.fail("model.vocab_size", fmt::format("is below the {} ids of data.synthetic {} (2 + keys + values); use "
                                                "at least {}", o.task.vocab_size(), synthetic_task_name(o.task.task),
                                                o.task.vocab_size()));
  if (train.seq_len != o.task.seq_len())
    config.fail("train.seq_len", fmt::format("must be {}, the row length of data.synthetic {} with {} pairs and {} "
                                             "queries", o.task.seq_len(), synthetic_task_name(o.task.task),
                                             o.task.num_pairs, o.task.num_queries));
  return o;
}

CheckpointOptions CheckpointOptions::from(const Config& config) {
  CheckpointOptions o;
  o.run_dir = config.get_string("run.dir");
  o.overwrite = config.get_bool("run.overwrite");
  o.every = config.get_int("ckpt.every");
  o.keep_last = config.get_int("ckpt.keep_last");
  o.async = config.get_bool("ckpt.async");
  o.resume = config.get_string("ckpt.resume");
  MT_CHECK(!o.run_dir.empty(), "{}: run.dir is empty; set it to the run's directory, e.g. runs/my-run",
           config.where("run.dir"));
  static const std::regex step_name(R"(step_\d{8})");
  if (!o.resume_none() && o.resume != "auto" && !std::regex_match(o.resume, step_name))
    config.fail("ckpt.resume", "must be none, auto or a checkpoint name such as step_00000030");
  return o;
}

}  // namespace moetrain
