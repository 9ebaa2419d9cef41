#include "train/trainer.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <unistd.h>
#include <filesystem>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "autograd/grad_mode.h"
#include "autograd/profile.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/cublas.h"
#include "backend/cuda/runtime.h"
#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "comm/watchdog.h"
#include "core/format.h"
#include "data/loader.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"
#include "nn/hybrid.h"
#include "nn/ledger.h"
#include "ops/elementwise.h"
#include "ops/kda_kernels.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "train/distributed.h"
#include "train/eval.h"
#include "train/fault.h"
#include "train/metrics.h"
#include "train/model_source.h"
#include "train/sampling.h"

namespace moetrain {

namespace {

using Clock = std::chrono::steady_clock;

double peak_rss_bytes() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return static_cast<double>(r.ru_maxrss) * 1024.0;
}

// Resident bytes now (/proc/self/statm); 0 where it cannot be read.
double current_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long size = 0, resident = 0;
  const bool ok = std::fscanf(f, "%ld %ld", &size, &resident) == 2;
  std::fclose(f);
  return ok ? static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) : 0;
}

// The ledger's memory estimate for one rank against what the ranks really held:
// peak RSS per rank (max and min over ranks), less the process's own footprint
// measured before the model was built (libraries, MPI, buffers: not the model's).
// Collective.
void report_memory(Distributed& dist, const Ledger& ledger, double baseline_rss) {
  Tensor mine = empty({2}, DType::f64);
  mine.data<double>()[0] = peak_rss_bytes();
  mine.data<double>()[1] = baseline_rss;
  Tensor all = dist.size() > 1 ? dist.world->all_gather(mine) : mine;  // [2 * ranks]
  const double* v = all.data<double>();
  int worst = 0;
  double lowest = v[0];
  for (int r = 0; r < dist.size(); ++r) {
    if (v[2 * r] > v[2 * worst]) worst = r;
    lowest = std::min(lowest, v[2 * r]);
  }
  const double estimate = ledger.state_bytes_per_rank + ledger.activation_bytes_per_rank;
  const double predicted = estimate + v[2 * worst + 1];
  spdlog::info("memory per rank: peak RSS {} (rank {}; lowest {}) against {} predicted = the ledger's {} + {} "
               "resident before the model was built: peak / predicted = {:.3f}",
               human_bytes(v[2 * worst]), worst, human_bytes(lowest), human_bytes(predicted), human_bytes(estimate),
               human_bytes(v[2 * worst + 1]), v[2 * worst] / predicted);
}

// Parameters by component, FLOPs per token and the ledger's memory estimate per rank, before step 1.
void report(const LanguageModel& model, const Config& config, const Ledger& ledger, int64_t tokens_per_step) {
  std::map<std::string, int64_t> groups;
  for (const NamedParameter& p : model.parameters()) groups[p.group] += p.tensor.numel();
  int64_t total = count_parameters(model.parameters());
  spdlog::info("model {}: {}", model.arch(), model.describe());
  for (const auto& [group, n] : groups)
    spdlog::info("  {:<10} {:>14} parameters ({:5.1f}%)", group, with_commas(n), 100.0 * n / total);
  spdlog::info("  {:<10} {:>14} parameters{}", "total", with_commas(total),
               model.arch() == "gpt2" ? " (LM head tied to wte)" : "");
  int64_t T = config.get_int("train.seq_len");
  spdlog::info("  FLOPs/token {:.3g}, {:.3g} per optimizer step of {} tokens", model.flops_per_token(T),
               model.flops_per_token(T) * tokens_per_step, with_commas(tokens_per_step));
  spdlog::info("  memory estimate per rank (ledger): {} weights+grads+AdamW, ~{} activations per micro-batch",
               human_bytes(ledger.state_bytes_per_rank), human_bytes(ledger.activation_bytes_per_rank));
}

// fault.kind = nan_grad (a testing aid): a NaN in the first gradient of this rank.
void inject_nan_grad(const ParameterList& params) {
  for (const NamedParameter& p : params)
    if (p.tensor.grad().defined()) {
      fill_(p.tensor.grad(), std::nan(""));
      return;
    }
}

// A skipped step's MoE assignments do not move the router biases.
void reset_moe_stats(LanguageModel& model) {
  if (auto* hybrid = dynamic_cast<HybridModel*>(&model))
    for (MoeLayer* m : hybrid->moe_layers()) m->stats().reset();
}

// Once per optimizer step, for MoE models: the aux-loss-free bias update (§9.2)
// from this step's assignments (all micro-batches), then the load metrics per
// layer (max/mean tokens per expert, dead experts); the statistics restart.
struct MoeStepSummary {
  std::vector<std::pair<std::string, MetricsWriter::Value>> fields;
  double worst_max_over_mean = 0;
  int64_t dead = 0, dropped = 0;
};
MoeStepSummary moe_step(LanguageModel& model) {
  MoeStepSummary out;
  auto* hybrid = dynamic_cast<HybridModel*>(&model);
  if (!hybrid) return out;
  const std::vector<MoeLayer*> layers = hybrid->moe_layers();
  for (size_t i = 0; i < layers.size(); ++i) {
    MoeStats& st = layers[i]->stats();
    layers[i]->update_bias(st.tokens_per_expert);
    const MoeLoad load = moe_load(st.tokens_per_expert);
    out.fields.emplace_back(fmt::format("moe{}_max_over_mean", i), load.max_over_mean);
    out.fields.emplace_back(fmt::format("moe{}_dead_experts", i), load.dead);
    out.worst_max_over_mean = std::max(out.worst_max_over_mean, load.max_over_mean);
    out.dead += load.dead;
    out.dropped += st.dropped;
    st.reset();
  }
  if (!layers.empty()) {
    out.fields.emplace_back("moe_max_over_mean", out.worst_max_over_mean);
    out.fields.emplace_back("moe_dead_experts", out.dead);
    out.fields.emplace_back("moe_dropped", out.dropped);
  }
  return out;
}

// SIGUSR1: save a checkpoint and exit cleanly at the end of the current step.
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int) { g_stop_signal = 1; }

struct StopSignalHandler {
  struct sigaction previous {};
  StopSignalHandler() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, &previous);
  }
  ~StopSignalHandler() { sigaction(SIGUSR1, &previous, nullptr); }
};

// Whether any rank got SIGUSR1 (mpirun forwards it to every rank, but not
// necessarily within the same step): every rank takes the same decision.
bool stop_requested(Distributed& dist) {
  if (dist.size() == 1) return g_stop_signal != 0;
  Tensor flag = full({1}, g_stop_signal != 0 ? 1 : 0, DType::i32);
  dist.world->all_reduce_sum(flag);
  return flag.data<int32_t>()[0] > 0;
}

CheckpointKillPoint kill_point(const std::string& phase) {
  if (phase == "before_commit") return CheckpointKillPoint::before_commit;
  if (phase == "before_rename") return CheckpointKillPoint::before_rename;
  return CheckpointKillPoint::before_latest;
}

std::unique_ptr<data::DataLoader> open_loader(const Config& config, const std::string& key, data::LoaderOrder order,
                                              int32_t vocab) {
  std::string pattern = config.get_string(key);
  if (pattern.empty()) return nullptr;
  data::DataLoaderOptions o;
  o.batch_size = config.get_int("train.batch_size");
  o.seq_len = config.get_int("train.seq_len");
  o.vocab_size = vocab;
  o.seed = static_cast<uint64_t>(config.get_int("train.seed"));
  o.order = order;
  try {
    return std::make_unique<data::DataLoader>(pattern, o);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("{}: {} = '{}': {}", config.where(key), key, pattern, e.what()));
  }
}

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

// Held-out rows of a synthetic task come from Generator(train.seed + kHeldOutSeed),
// a stream independent of the training rows' Generator(train.seed).
constexpr uint64_t kHeldOutSeed = 1000003;

// Training batches from token shards or from a synthetic task.
struct TrainStream {
  std::unique_ptr<data::DataLoader> loader;
  std::unique_ptr<data::SyntheticStream> synthetic;
  data::Batch next() { return loader ? loader->next() : static_cast<data::Batch>(synthetic->next()); }
  data::LoaderState state() const { return loader ? loader->state() : synthetic->state(); }
  void set_state(const data::LoaderState& s) { loader ? loader->set_state(s) : synthetic->set_state(s); }
};

std::string sample_text(LanguageModel& model, const data::Tokenizer& tok, const Config& config, uint64_t seed) {
  SamplingOptions o;
  o.max_new_tokens = config.get_int("train.sample_tokens");
  o.temperature = config.get_number("train.sample_temperature");
  o.top_k = config.get_int("train.sample_top_k");
  o.seed = seed;
  std::vector<int32_t> prompt = tok.encode(config.get_string("train.sample_prompt"));
  if (prompt.empty()) prompt.push_back(tok.eot_token().value_or(0));
  return tok.decode(generate(model, prompt, o));
}

}  // namespace

TrainSummary train(const Config& config) {
  // Mixed precision computes bf16 on CUDA only (the CPU kernels are f32/f64).
  const bool mixed_precision = config.get_string("train.dtype") == "bf16";
  if (mixed_precision && config.get_string("train.device") != "cuda")
    config.fail("train.dtype", fmt::format("is bf16 (mixed precision), which needs train.device: cuda, but "
                                           "train.device is {}; set train.device: cuda or train.dtype: f32",
                                           config.get_string("train.device")));
  Distributed dist = make_distributed(config);
  // Under mpirun only the root logs (warnings and errors come from every rank).
  if (!dist.root()) spdlog::set_level(spdlog::level::warn);
  const std::filesystem::path run_dir = config.get_string("run.dir");
  if (dist.root()) {
    std::filesystem::create_directories(run_dir);
    config.save((run_dir / "config.resolved.yaml").string());
  }
  // 0: the CLI's default, cores / ranks on this node (backend/cpu/parallel.h).
  if (int64_t threads = config.get_int("train.threads"); threads > 0) cpu::set_num_threads(static_cast<int>(threads));
  log_rank_table(dist, cpu::num_threads());

  const int64_t B = config.get_int("train.batch_size"), T = config.get_int("train.seq_len");
  const int64_t accum = config.get_int("train.grad_accum"), max_steps = config.get_int("train.max_steps");
  const bool synthetic = config.get_string("data.synthetic") != "none";
  std::unique_ptr<data::Tokenizer> tokenizer;  // none for a synthetic task: its ids are not text (no samples)
  const int64_t vocab = config.get_int("model.vocab_size");
  if (!synthetic) {
    tokenizer = data::make_tokenizer(config.get_string("data.tokenizer"), config.get_string("data.tokenizer_dir"));
    if (vocab < tokenizer->vocab_size())
      config.fail("model.vocab_size", fmt::format("is below the {} tokenizer's {} ids; use at least {}",
                                                  tokenizer->name(), tokenizer->vocab_size(), tokenizer->vocab_size()));
  }
  TrainStream train_loader;
  std::unique_ptr<data::DataLoader> val_loader;
  data::SyntheticOptions task;
  if (synthetic) {
    task = synthetic_options(config);
    if (vocab < task.vocab_size())
      config.fail("model.vocab_size", fmt::format("is below the {} ids of data.synthetic {} (2 + keys + values); use "
                                                  "at least {}", task.vocab_size(), synthetic_task_name(task.task),
                                                  task.vocab_size()));
    if (T != task.seq_len())
      config.fail("train.seq_len", fmt::format("must be {}, the row length of data.synthetic {} with {} pairs and {} "
                                               "queries", task.seq_len(), synthetic_task_name(task.task),
                                               task.num_pairs, task.num_queries));
    train_loader.synthetic =
        std::make_unique<data::SyntheticStream>(task, B, static_cast<uint64_t>(config.get_int("train.seed")));
  } else {
    MT_CHECK(!config.get_string("data.train").empty(), "{}: data.train is empty; set it to the training shards, e.g. "
             "data/shakespeare/train_*.bin (made by `moetrain prepare`)", config.where("data.train"));
    train_loader.loader = open_loader(config, "data.train", data::LoaderOrder::shuffled, static_cast<int32_t>(vocab));
    val_loader = open_loader(config, "data.val", data::LoaderOrder::sequential, static_cast<int32_t>(vocab));
  }

  const double baseline_rss = current_rss_bytes();
  const Ledger ledger = make_ledger(config, {dist.grid.dp, dist.grid.ep});
  std::unique_ptr<LanguageModel> model = build_model(config, dist.shard());
  if (dist.grid.ep > 1) dynamic_cast<HybridModel&>(*model).set_expert_group(dist.grid.ep_group.get());
  ParameterList& params = model->parameters();
  if (config.get_bool("train.decay_embeddings"))
    for (NamedParameter& p : params)
      if (p.group == "embedding") p.decay = true;
  AdamW opt(params, {config.get_number("train.beta1"), config.get_number("train.beta2"),
                     config.get_number("train.eps"), config.get_number("train.weight_decay")});
  LrSchedule schedule{parse_schedule(config.get_string("train.schedule")), config.get_number("train.lr"),
                      config.get_number("train.min_lr"), config.get_int("train.warmup_steps"), max_steps,
                      config.get_number("train.wsd_decay_frac")};
  const double clip = config.get_number("train.grad_clip");
  const int64_t eval_every = config.get_int("train.eval_every"), sample_every = config.get_int("train.sample_every");
  const int64_t log_every = config.get_int("train.log_every"), eval_batches = config.get_int("train.eval_batches");

  if (synthetic)
    spdlog::info("run {} | {} threads | synthetic {}: {} pairs, {} queries, {} keys, {} values, rows of {} tokens",
                 run_dir.string(), cpu::num_threads(), synthetic_task_name(task.task), task.num_pairs,
                 task.num_queries, task.num_keys, task.num_values, T + 1);
  else
    spdlog::info("run {} | {} threads | train data {} windows of {} tokens{}", run_dir.string(), cpu::num_threads(),
                 train_loader.loader->num_windows(), T + 1,
                 val_loader ? fmt::format(" | val {} windows", val_loader->num_windows()) : std::string());
  if (dist.root()) report(*model, config, ledger, B * T * accum * dist.size());
  std::unique_ptr<MetricsWriter> metrics;  // opened after a resume has trimmed the file

  double last_val_acc = -1;
  auto run_eval = [&](int64_t step) {
    if (synthetic) {  // every rank, the same held-out rows
      const AnswerScore a = evaluate_answers(*model, task, B, eval_batches,
                                             static_cast<uint64_t>(config.get_int("train.seed")) + kHeldOutSeed);
      spdlog::info("step {}/{} | val loss {:.4f} | val acc {:.4f} ({} answers)", step, max_steps, a.loss, a.accuracy,
                   a.answers);
      if (metrics) metrics->write({{"step", step}, {"val_loss", a.loss}, {"val_acc", a.accuracy}});
      last_val_acc = a.accuracy;
      return a.loss;
    }
    if (!val_loader) return -1.0;
    val_loader->set_state({});  // always the same windows, from the start of the data
    double v = evaluate(*model, *val_loader, eval_batches);  // every rank, the same windows
    spdlog::info("step {}/{} | val loss {:.4f}", step, max_steps, v);
    if (metrics) metrics->write({{"step", step}, {"val_loss", v}});
    return v;
  };
  auto run_sample = [&](int64_t step) {
    if (!tokenizer) return;
    std::string text = sample_text(*model, *tokenizer, config, static_cast<uint64_t>(config.get_int("train.seed")));
    spdlog::info("sample at step {}:\n{}{}", step, config.get_string("train.sample_prompt"), text);
  };

  const bool nan_policy_abort = config.get_string("train.nan_policy") == "abort";
  // train.profile: components timed from the second step of this run on (the first
  // allocates its buffers); eval, samples and checkpoints are not counted.
  const bool profiling = config.get_bool("train.profile");
  int64_t profiled_steps = 0;
  if (profiling) profile::reset();
  const int64_t max_consecutive_skips = config.get_int("train.max_consecutive_skips");
  const std::string fault_kind = config.get_string("fault.kind");
  const bool inject = fault_kind == "nan_grad";
  const int64_t fault_step = config.get_int("fault.step"), fault_rank = config.get_int("fault.rank");
  if (inject) spdlog::warn("fault injection (a testing aid): NaN gradient on rank {} at step {}", fault_rank, fault_step);
  const SignalFault signal_fault(config, dist.rank(), dist.size());  // fault.kind = kill | stop
  const bool kill_in_save = fault_kind == "kill_during_ckpt";
  if (kill_in_save && config.get_string("fault.phase") != "before_commit" && fault_rank != 0)
    config.fail("fault.rank", fmt::format("fault.phase {} happens on rank 0 only; set fault.rank: 0",
                                          config.get_string("fault.phase")));
  if (kill_in_save)
    spdlog::warn("fault injection (a testing aid): SIGKILL on rank {} while saving the checkpoint of step {} ({})",
                 fault_rank, fault_step, config.get_string("fault.phase"));

  // Checkpoints: resume (rank 0 chooses, every rank loads what it needs).
  const int64_t ckpt_every = config.get_int("ckpt.every");
  SaveOptions save_options;
  save_options.keep_last = config.get_int("ckpt.keep_last");
  TrainProgress progress;
  {
    Tensor chosen = full({1}, -1, DType::i64);
    if (dist.root()) {
      const std::string dir = find_checkpoint(run_dir.string(), config);
      if (!dir.empty()) chosen.data<int64_t>()[0] = std::stoll(std::filesystem::path(dir).filename().string().substr(5));
    }
    if (dist.size() > 1) dist.world->broadcast(chosen, 0);
    if (const int64_t step = chosen.data<int64_t>()[0]; step >= 0) {
      const std::string dir = (std::filesystem::path(checkpoints_dir(run_dir.string())) / checkpoint_name(step)).string();
      const auto t0 = Clock::now();
      progress = load_checkpoint(dist, dir, *model, &opt, config);
      train_loader.set_state(progress.loader);
      spdlog::info("resumed from {} (step {}, {} tokens seen, {} skipped steps) in {:.2f} s", dir, progress.step,
                   with_commas(progress.tokens), progress.skipped,
                   std::chrono::duration<double>(Clock::now() - t0).count());
      if (dist.root()) {
        const int64_t dropped = truncate_metrics_after((run_dir / "metrics.jsonl").string(), progress.step);
        if (dropped > 0)
          spdlog::info("  metrics.jsonl: dropped {} records after step {} (the run that stopped wrote them)", dropped,
                       progress.step);
      }
    }
  }
  // train.device = cuda: parameters and moments move to the GPU after a resume
  // has loaded them on the host; batches follow them each step.
  Device device = kCpu;
  if (config.get_string("train.device") == "cuda") {
    if (!cuda::built_with_cuda())
      config.fail("train.device", "is cuda but this moetrain was built without CUDA; rebuild with the CUDA toolkit "
                                  "(cmake -DMOETRAIN_CUDA=ON) or set train.device: cpu");
    if (cuda::device_count() == 0)
      config.fail("train.device", "is cuda but no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), "
                                  "or set train.device: cpu");
    device = Device{DeviceKind::cuda, cuda::select_device(cpu::launcher_local_rank())};
    cuda::set_allow_tf32(config.get_bool("train.tf32"));
    // The chunked KDA's state products on TF32 tensor cores (ops/kda_tc.h): with
    // train.tf32, and in bf16 runs, whose KDA gets f32 inputs (the layer computes
    // its gates and state in f32) and whose other products are bf16 already.
    cuda::set_kda_tensor_cores(config.get_bool("train.tf32") || mixed_precision);
    for (const NamedParameter& p : params) move_to_device_(p.tensor, device);
    for (const Tensor& t : opt.exp_avg()) move_to_device_(t, device);
    for (const Tensor& t : opt.exp_avg_sq()) move_to_device_(t, device);
    spdlog::info("training on {} ({})", device, cuda::device_name(device.index));
  }
  if (mixed_precision) {
    // Parameters become bf16 on the device; AdamW keeps their f32 values as master
    // weights (what checkpoints and the exported model hold).
    opt.convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
    int64_t kept = 0;
    for (const NamedParameter& p : params) kept += p.tensor.dtype() == DType::f32 ? p.tensor.numel() : 0;
    spdlog::info("mixed precision: bf16 parameters and activations, f32 master weights and AdamW moments; {} of {} "
                 "parameters stay f32 (router, KDA gate, conv and output norm)", with_commas(kept),
                 with_commas(count_parameters(params)));
  }
  if (dist.root()) metrics = std::make_unique<MetricsWriter>((run_dir / "metrics.jsonl").string());
  StopSignalHandler stop_signal;
  bool stopped = false;
  CheckpointSaver saver(dist, run_dir.string(), config, config.get_bool("ckpt.async"));
  auto log_saved = [&](const std::optional<SaveResult>& saved) {
    if (saved && saver.async())
      spdlog::info("checkpoint {} committed {:.2f} s after it began (written in the background; {} in this rank's "
                   "file)", saved->dir, saved->seconds, human_bytes(static_cast<double>(saved->bytes)));
    else if (saved)
      spdlog::info("checkpoint {} saved in {:.2f} s ({} in this rank's file, {:.0f} MB/s)", saved->dir,
                   saved->seconds, human_bytes(static_cast<double>(saved->bytes)),
                   saved->bytes / 1e6 / std::max(saved->seconds, 1e-9));
  };
  // End of a step (taken or skipped): a checkpoint every ckpt.every steps, at the
  // last step and when SIGUSR1 asks to stop. Returns true to stop.
  auto end_of_step = [&](int64_t done) {
    const bool stop = stop_requested(dist);
    if (saver.async()) log_saved(saver.poll());  // commits a background save once every rank wrote its file
    if (stop) spdlog::warn("SIGUSR1: saving a checkpoint at step {} and exiting", done);
    if (stop || (ckpt_every > 0 && (done % ckpt_every == 0 || done == max_steps))) {
      progress.step = done;
      progress.loader = train_loader.state();
      SaveOptions o = save_options;
      if (kill_in_save && done == fault_step && dist.rank() == fault_rank)
        o.kill_at = kill_point(config.get_string("fault.phase"));
      log_saved(saver.save(*model, opt, progress, o));
    }
    if (stop) log_saved(saver.finish());
    return stop && done < max_steps;  // at the last step the run simply ends
  };

  TrainSummary summary;
  summary.steps = progress.step;
  auto run_start = Clock::now();
  int64_t& tokens_seen = progress.tokens;
  int64_t& skipped = progress.skipped;
  int64_t& consecutive_skips = progress.consecutive_skips;
  const int64_t tokens_at_start = progress.tokens;
  for (int64_t step = progress.step; step < max_steps; ++step) {
    auto t0 = Clock::now();
    if (profiling && step > progress.step) profile::set_enabled(true);
    comm::set_watchdog_step(step + 1);
    signal_fault.at_step_start(step + 1);
    double lr = schedule.at(step);
    {
      profile::Region region("optimizer");
      opt.zero_grad();
    }
    double loss_sum = 0;
    for (int64_t micro = 0; micro < accum; ++micro) {
      data::Batch batch;  // this rank's share of the stream: batches rank, rank + world, ...
      {
        profile::Region region("data");
        for (int r = 0; r < dist.size(); ++r) {
          data::Batch b = train_loader.next();
          if (r == dist.rank()) batch = std::move(b);
        }
      }
      Tensor loss = model->loss(batch.inputs.to(device), batch.targets.to(device), true);
      loss_sum += loss.item<double>();
      // The last micro-batch's backward sums finished gradient buckets as it goes
      // (train.overlap_grad_sync); not on a fault-injection step, whose NaN is
      // written after backward (every rank knows the step, so all agree).
      std::unique_ptr<autograd::GradReadyHookGuard> overlapped;
      if (micro == accum - 1 && !(inject && fault_step == step + 1))
        overlapped = begin_overlapped_grad_sync(dist, *model);
      (accum > 1 ? mul_scalar(loss, 1.0 / static_cast<double>(accum)) : loss).backward();
    }
    if (inject && fault_step == step + 1 && fault_rank == dist.rank()) inject_nan_grad(params);
    std::optional<profile::Region> sync_region(std::in_place, "grad sync+clip");
    double loss = mean_over_world(dist, loss_sum / static_cast<double>(accum));
    sync_gradients(dist, *model);
    double gnorm = clip_grad_norm(dist, *model, clip);
    sync_region.reset();
    // Non-finite values reach every rank through the loss mean and the gradient
    // sums (the norm of expert shards is summed over the ep group), so every rank
    // takes the same decision here without another collective.
    if (!std::isfinite(loss) || !std::isfinite(gnorm)) {
      ++skipped;
      ++consecutive_skips;
      const std::string what = fmt::format("step {}: loss {}, gradient norm {}", step + 1, loss, gnorm);
      if (nan_policy_abort)
        throw NumericalError(fmt::format("{} (train.nan_policy = abort); lower train.lr (now {}) or check the data",
                                         what, schedule.lr));
      if (consecutive_skips > max_consecutive_skips)
        throw NumericalError(fmt::format("{}: {} steps in a row were not finite (train.max_consecutive_skips = {}); "
                                         "lower train.lr (now {}) or check the data", what, consecutive_skips,
                                         max_consecutive_skips, schedule.lr));
      spdlog::warn("{}: step skipped on every rank (train.nan_policy = skip; {} skipped so far)", what, skipped);
      profile::set_enabled(false);
      opt.zero_grad();
      reset_moe_stats(*model);
      if (metrics) metrics->write({{"step", step + 1}, {"skipped", true}, {"skipped_steps", skipped}});
      if (end_of_step(step + 1)) {
        stopped = true;
        break;
      }
      continue;
    }
    consecutive_skips = 0;
    all_reduce_moe_stats(dist, *model);
    const MoeStepSummary moe = moe_step(*model);
    {
      profile::Region region("optimizer");
      opt.step(lr);
    }
    if (profile::enabled()) {
      profile::set_enabled(false);  // what follows (logging, eval, checkpoints) is not a step's work
      ++profiled_steps;
    }
    double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    tokens_seen += B * T * accum * dist.size();
    double tok_s = static_cast<double>(B * T * accum * dist.size()) / sec;
    summary = {step + 1, loss, summary.last_val_loss, summary.last_val_acc, tok_s};
    if ((step + 1) % log_every == 0 || step == 0 || step + 1 == max_steps)
      spdlog::info("step {}/{} | loss {:.4f} | lr {:.1e} | gnorm {:.2f} | {} tok/s | {:.0f} ms{}", step + 1, max_steps,
                   loss, lr, gnorm, with_commas(std::llround(tok_s)), sec * 1e3,
                   moe.fields.empty() ? std::string()
                                      : fmt::format(" | moe max/mean {:.2f}, {} dead{}", moe.worst_max_over_mean,
                                                    moe.dead, moe.dropped ? fmt::format(", {} dropped", moe.dropped)
                                                                          : std::string()));
    std::vector<std::pair<std::string, MetricsWriter::Value>> record{
        {"step", step + 1}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm}, {"tok_per_s", tok_s},
        {"step_ms", sec * 1e3}, {"tokens", tokens_seen}};
    if (skipped > 0) record.emplace_back("skipped_steps", skipped);
    if (device.is_cuda())  // the caching allocator's peak: what the GPU had to hold
      record.emplace_back("gpu_peak_reserved_bytes", cuda::memory_stats(device.index).peak_reserved_bytes);
    record.insert(record.end(), moe.fields.begin(), moe.fields.end());
    if (metrics) metrics->write(record);
    if (step == 0) spdlog::info("  peak memory after the first step: {}", human_bytes(peak_rss_bytes()));
    if (step == 0 && device.is_cuda()) {
      const cuda::MemoryStats m = cuda::memory_stats(device.index);
      spdlog::info("  {} memory after the first step: {} peak in tensors, {} peak reserved", device,
                   human_bytes(static_cast<double>(m.peak_allocated_bytes)),
                   human_bytes(static_cast<double>(m.peak_reserved_bytes)));
    }
    bool last = step + 1 == max_steps;
    if (eval_every > 0 && ((step + 1) % eval_every == 0 || last)) {
      summary.last_val_loss = run_eval(step + 1);
      summary.last_val_acc = last_val_acc;
    }
    if (sample_every > 0 && (step + 1) % sample_every == 0 && !last) run_sample(step + 1);
    if (end_of_step(step + 1)) {
      stopped = true;
      break;
    }
  }
  log_saved(saver.finish());  // a background save still in flight
  double total_sec = std::chrono::duration<double>(Clock::now() - run_start).count();
  if (max_steps > 0 && total_sec > 0)
    summary.tokens_per_second = static_cast<double>(tokens_seen - tokens_at_start) / total_sec;
  if (tokens_seen > tokens_at_start) report_memory(dist, ledger, baseline_rss);  // steps ran here
  if (profiling) {
    profile::set_enabled(false);
    if (profiled_steps > 0)
      spdlog::info("time per step by component (train.profile; this rank, mean of {} steps after the first):\n{}",
                   profiled_steps, profile::format_table(profile::entries(), profiled_steps));
    else
      spdlog::info("train.profile: no step after the first ran here, nothing to report");
  }
  if (stopped) {
    spdlog::info("stopped by SIGUSR1 after step {}; continue with ckpt.resume: auto", progress.step);
    return summary;
  }
  if (sample_every > 0 || max_steps == 0) run_sample(summary.steps);

  std::filesystem::path model_dir = run_dir / "model";
  if (dist.grid.ep > 1 || mixed_precision) {
    // Collective: experts from the whole ep group; under mixed precision the f32 master weights.
    const ParameterList state = full_state(dist, *model, mixed_precision ? &opt : nullptr);
    if (dist.root()) export_model(*model, model_dir.string(), &state);
  } else if (dist.root()) {
    export_model(*model, model_dir.string());
  }
  if (dist.root()) config.save((model_dir / "config.resolved.yaml").string());
  spdlog::info("done: {} steps in {:.1f} s ({} tok/s); model written to {}", summary.steps, total_sec,
               with_commas(std::llround(summary.tokens_per_second)), model_dir.string());
  return summary;
}

}  // namespace moetrain
