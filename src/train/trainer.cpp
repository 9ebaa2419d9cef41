#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "backend/cpu/onednn.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/cublas.h"
#include "backend/cuda/runtime.h"
#include "comm/communicator.h"
#include "comm/watchdog.h"
#include "core/format.h"
#include "core/grad_mode.h"
#include "core/profile.h"
#include "config/schema.h"
#include "data/synthetic.h"
#include "data/utf8.h"
#include "nn/model_family.h"
#include "nn/moe.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/kda/kda_kernels.h"
#include "train/eval.h"
#include "train/model_source.h"
#include "train/pipeline.h"
#include "train/sampling.h"

namespace moetrain {

namespace {

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
  const double estimate = ledger.bytes_per_rank;  // state, activations, gradient buckets
  const double predicted = estimate + v[2 * worst + 1];
  spdlog::info("memory per rank: peak RSS {} (rank {}; lowest {}) against {} predicted = the ledger's {} + {} "
               "resident before the model was built: peak / predicted = {:.3f}",
               human_bytes(v[2 * worst]), worst, human_bytes(lowest), human_bytes(predicted), human_bytes(estimate),
               human_bytes(v[2 * worst + 1]), v[2 * worst] / predicted);
}

// Parameters by component, FLOPs per token and the ledger's memory estimate per rank, before step 1.
void report_model(const LanguageModel& model, int64_t seq_len, const Ledger& ledger, int64_t tokens_per_step) {
  std::map<std::string, int64_t> groups;
  for (const NamedParameter& p : model.parameters()) groups[p.group] += p.tensor.numel();
  int64_t total = count_parameters(model.parameters());
  spdlog::info("model {}: {}", model.arch(), model.describe());
  for (const auto& [group, n] : groups)
    spdlog::info("  {:<10} {:>14} parameters ({:5.1f}%)", group, with_commas(n), 100.0 * n / total);
  const PipelineStage stage = model.pipeline_stage();
  if (!stage.whole()) {  // pipeline: the groups above are this rank's stage
    std::string layers;
    for (int64_t c = 0; c < stage.chunks; ++c) {
      const StageLayers r = model.pipeline_stage_layers(c);
      layers += fmt::format("{}{}-{}", c ? ", " : "", r.first, r.end - 1);
    }
    spdlog::info("  {:<10} {:>14} parameters on rank 0: stage 1 of {} (layers {} and the embedding{}, train.pp {}{})",
                 "this rank", with_commas(total), stage.count, layers,
                 ledger.layout.ep > 1 ? fmt::format("; its 1/{} of the routed experts, train.ep {}", ledger.layout.ep,
                                                    ledger.layout.ep)
                                      : std::string(),
                 stage.count, stage.chunks > 1 ? fmt::format(", train.pp_virtual {}", stage.chunks) : std::string());
    spdlog::info("  {:<10} {:>14} parameters in the model ({} active per token)", "total", with_commas(ledger.total),
                 with_commas(ledger.active));
  } else if (ledger.layout.ep > 1 && total != ledger.total) {  // expert parallel: the groups above are this rank's
    spdlog::info("  {:<10} {:>14} parameters on rank 0 (the replicated ones + its 1/{} of the routed experts, "
                 "train.ep {})", "this rank", with_commas(total), ledger.layout.ep, ledger.layout.ep);
    spdlog::info("  {:<10} {:>14} parameters in the model ({} active per token)", "total", with_commas(ledger.total),
                 with_commas(ledger.active));
  } else {
    spdlog::info("  {:<10} {:>14} parameters{}", "total", with_commas(total),
                 model_family(model.arch()).capabilities.tied_embeddings == TiedEmbeddings::always
                     ? " (LM head tied to the token embedding)"
                     : "");
  }
  spdlog::info("  FLOPs/token {:.3g}, {:.3g} per optimizer step of {} tokens", model.flops_per_token(seq_len),
               model.flops_per_token(seq_len) * tokens_per_step, with_commas(tokens_per_step));
  if (ledger.layout.pp > 1) {  // the ledger's worst stage: its state and its 1F1B micro-batches in flight
    const StageLedger& worst = ledger.stages[static_cast<size_t>(ledger.worst_stage)];
    spdlog::info("  memory estimate per rank (ledger, stage {}, the largest): {} weights+grads+optimizer state, ~{} activations "
                 "({} micro-batches in flight)",
                 ledger.worst_stage, human_bytes(ledger.state_bytes_per_rank),
                 human_bytes(ledger.activation_bytes_per_rank), worst.num_micro_batches_in_flight);
  } else {
    spdlog::info("  memory estimate per rank (ledger): {} weights+grads+optimizer state, ~{} activations per micro-batch",
                 human_bytes(ledger.state_bytes_per_rank), human_bytes(ledger.activation_bytes_per_rank));
  }
}

// A skipped step's MoE assignments do not move the router biases.
void reset_moe_stats(LanguageModel& model) {
  for (MoeLayer* m : model.moe_layers()) m->stats().reset();
}

// Once per optimizer step, for MoE models: the aux-loss-free bias update (docs/model.md#aux-loss-free-bias-update)
// from this step's assignments (all micro-batches), then the load metrics per
// layer (max/mean tokens per expert, dead experts); the statistics restart.
MoeStepSummary moe_step(LanguageModel& model) {
  MoeStepSummary out;
  const std::vector<MoeLayer*> layers = model.moe_layers();
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

// Held-out rows of a synthetic task come from Generator(train.seed + kHeldOutSeed),
// a stream independent of the training rows' Generator(train.seed).
constexpr uint64_t kHeldOutSeed = 1000003;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// "4:05", "1:02:03".
std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds) + 0.5);
  if (s < 3600) return fmt::format("{}:{:02}", s / 60, s % 60);
  return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
}

// The peak MFU is measured against when train.peak_tflops is 0: FLOP/s of a 1024^3
// matrix product in `dtype` on `device` with the run's threads, the best of three
// after a warm-up (about 50 ms on 2 cores). Its own seeds: the training RNG is untouched.
double measured_gemm_flops(Device device, DType dtype) {
  constexpr int64_t n = 1024;
  NoGradGuard no_grad;
  const Tensor a = randn({n, n}, DType::f32, 11).to(dtype).to(device);
  const Tensor b = randn({n, n}, DType::f32, 12).to(dtype).to(device);
  double best = 0;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const Tensor c = matmul(a, b);
    if (device.is_cuda()) cuda::synchronize(device.index);
    const double s = seconds_since(t0);
    if (i > 0 && s > 0) best = std::max(best, 2.0 * n * n * n / s);
  }
  return best;
}

}  // namespace

// Training batches from token shards or from a synthetic task.
struct Trainer::Stream {
  std::unique_ptr<data::DataLoader> loader;
  std::unique_ptr<data::SyntheticStream> synthetic;
  data::Batch next() { return loader ? loader->next() : static_cast<data::Batch>(synthetic->next()); }
  data::LoaderState state() const { return loader ? loader->state() : synthetic->state(); }
  void set_state(const data::LoaderState& s) { loader ? loader->set_state(s) : synthetic->set_state(s); }
};

Trainer::Trainer(const Config& config)
    : config_(config),
      train_(TrainOptions::from(config)),
      data_(DataOptions::from(config, train_)),
      ckpt_(CheckpointOptions::from(config)),
      dist_(make_distributed(config)),
      faults_(FaultPlan::from(config, dist_.rank(), dist_.size())) {
  // Under mpirun only the root logs (warnings and errors come from every rank).
  if (!dist_.root()) spdlog::set_level(spdlog::level::warn);
  if (train_.cuda && !cuda::built_with_cuda())
    config.fail("train.device", "is cuda but this moetrain was built without CUDA; rebuild with the CUDA toolkit "
                                "(cmake -DMOETRAIN_CUDA=ON) or set train.device: cpu");
  if (dist_.root()) run_ = std::make_unique<RunDirectory>(ckpt_.run_dir);
  // 0: the CLI's default, cores / ranks on this node (backend/cpu/parallel.h).
  if (train_.threads > 0)
    cpu::set_num_threads(
        cpu::capped_thread_count(train_.threads, fmt::format("train.threads ({})", config.where("train.threads"))));
  log_rank_table(dist_, cpu::num_threads());
  faults_.at_startup();
  signals::throw_if_requested("while the run was being set up");
  open_data();
  build();
  signals::throw_if_requested("while the model was being built");
}

Trainer::~Trainer() = default;

void Trainer::open_data() {
  stream_ = std::make_unique<Stream>();
  if (data_.synthetic) {
    stream_->synthetic = std::make_unique<data::SyntheticStream>(data_.task, train_.batch_size, train_.seed);
    return;
  }
  tokenizer_ = data::make_tokenizer(data_.tokenizer, data_.tokenizer_dir);
  if (data_.vocab_size < tokenizer_->vocab_size())
    config_.fail("model.vocab_size", fmt::format("is below the {} tokenizer's {} ids; use at least {}",
                                                 tokenizer_->name(), tokenizer_->vocab_size(), tokenizer_->vocab_size()));
  auto open = [&](const char* key, const std::string& pattern, data::LoaderOrder order) {
    std::unique_ptr<data::DataLoader> loader;
    if (pattern.empty()) return loader;
    data::DataLoaderOptions o;
    o.batch_size = train_.batch_size;
    o.seq_len = train_.seq_len;
    o.vocab_size = data_.vocab_size;
    o.tokenizer_vocab_size = tokenizer_->vocab_size();
    o.seed = train_.seed;
    o.order = order;
    try {
      loader = std::make_unique<data::DataLoader>(pattern, o);
    } catch (const Error& e) {
      throw ConfigError(fmt::format("{}: {} = '{}': {}", config_.where(key), key, pattern, e.what()));
    }
    return loader;
  };
  stream_->loader = open("data.train", data_.train, data::LoaderOrder::shuffled);
  val_loader_ = open("data.val", data_.val, data::LoaderOrder::sequential);
}

void Trainer::build() {
  baseline_rss_ = current_rss_bytes();
  // The worst stage at pp > 1; at train.zero 1 the moments over each parameter's replicas.
  ledger_ = make_ledger(config_, {dist_.grid.dp, dist_.grid.ep, dist_.grid.pp, dist_.zero, 0, 0, dist_.pp_virtual});
  model_ = build_model(config_, expert_shard(dist_), PipelineStage{dist_.grid.pp_index, dist_.grid.pp, dist_.pp_virtual});
  if (dist_.grid.pp > 1)
    whole_model_ = pipelined_model(dist_, *model_, activation_dtype());
  if (dist_.grid.ep > 1) model_->set_expert_group(dist_.grid.ep_group.get());
  ParameterList& params = model_->parameters();
  if (train_.decay_embeddings)
    for (NamedParameter& p : params)
      if (p.group == "embedding") p.decay = true;
  opt_ = make_optimizer(params, train_.optimizer,
                        dist_.zero ? make_zero_shards(dist_, params, train_.optimizer) : std::vector<ElementRange>{});
  if (train_.optimizer.kind == "muon" && dist_.root()) {
    int64_t muon = 0;
    for (const NamedParameter& p : params) muon += uses_muon(train_.optimizer, p) ? p.tensor.numel() : 0;
    spdlog::info("train.optimizer muon: Muon on {} of the {} parameters (hidden matrices), AdamW on the rest "
                 "(embeddings, LM head, router gate, norms, biases, vectors)", with_commas(muon),
                 with_commas(count_parameters(params)));
  }
  if (dist_.zero && dist_.root()) {  // what the optimizer state takes here, against a whole copy
    double whole = 0;  // AdamW: two moments; Muon: one momentum, in the parameter's dtype
    for (const NamedParameter& p : params)
      whole += (uses_muon(train_.optimizer, p) ? 1.0 : 2.0) * static_cast<double>(p.tensor.nbytes());
    spdlog::info("train.zero 1: optimizer state on rank 0: {} of the {} a whole copy takes (sharded over the {} "
                 "replicas of the replicated parameters{})", human_bytes(static_cast<double>(opt_->state_bytes())),
                 human_bytes(whole), dist_.grid.replicas(),
                 dist_.grid.ep > 1 ? fmt::format(" and the {} of each expert shard", dist_.grid.dp) : "");
  }
  if (train_.qk_clip) {
    model_->set_track_max_logits(true);
    if (model_->qk_clip_sites().empty() && dist_.root())
      spdlog::warn("{}: train.qk_clip is on but {} no softmax attention layer (MLA or attention): nothing to clip",
                   config_.where("train.qk_clip"), dist_.grid.pp > 1 ? "the first pipeline stage has" : "the model has");
  }
  saver_ = std::make_unique<CheckpointSaver>(dist_, ckpt_.run_dir, config_, ckpt_.async);
  save_options_.keep_last = ckpt_.keep_last;
  if (train_.profile) profile::reset();
  report_start();
}

void Trainer::report_start() const {
  const data::SyntheticOptions& t = data_.task;
  if (data_.synthetic)
    spdlog::info("run {} | {} threads | synthetic {}: {} pairs, {} queries, {} keys, {} values, rows of {} tokens",
                 ckpt_.run_dir, cpu::num_threads(), synthetic_task_name(t.task), t.num_pairs, t.num_queries,
                 t.num_keys, t.num_values, train_.seq_len + 1);
  else
    spdlog::info("run {} | {} threads | train data {} windows of {} tokens{}", ckpt_.run_dir, cpu::num_threads(),
                 stream_->loader->num_windows(), train_.seq_len + 1,
                 val_loader_ ? fmt::format(" | val {} windows", val_loader_->num_windows()) : std::string());
  if (dist_.root()) report_model(*model_, train_.seq_len, *ledger_, train_.tokens_per_step(dist_.grid.replicas()));
}

// A resume with another config: each changed key is logged (root) with its old and
// new value; a learning-rate schedule that gives other values from the resumed step
// on is refused unless ckpt.schedule_change is apply (then it is logged as applied).
// Every rank runs the same comparison on the same files, so all refuse together.
void Trainer::check_config_changes(const std::string& dir, int64_t step) {
  std::optional<Config> saved;
  try {
    saved = Config::load(checkpoint_config_path(dir));
  } catch (const Error& e) {
    if (dist_.root())
      spdlog::warn("resume: cannot read the config {} was saved with, so changed keys are not listed: {}", dir,
                   e.what());
    return;
  }
  // The token tables' rows are ids: another vocabulary cannot resume, even when
  // the row counts agree (50257 padded to 64 has the 50304 rows of an unpadded
  // 50304; docs/checkpoints.md#resume-rules).
  const int64_t saved_vocab = saved->get_int("model.vocab_size"), vocab = config_.get_int("model.vocab_size");
  if (saved_vocab != vocab)
    config_.fail("model.vocab_size",
                 fmt::format("is {} but {} was saved with {}: the embedding and head rows are token ids, so the "
                             "checkpoint resumes only with its vocabulary (with model.vocab_pad_multiple the row "
                             "counts can agree while rows past the smaller vocabulary are trained ids in one and "
                             "padding in the other); resume with model.vocab_size {}, or export the checkpoint "
                             "(moetrain export) and start from it with model.init_from",
                             vocab, dir, saved_vocab, saved_vocab));
  // The optimizer's state is its rule's (AdamW's moments, Muon's momentum): another
  // rule would start with state of the wrong kind or none.
  const std::string saved_optimizer = saved->get_string("train.optimizer");
  if (saved_optimizer != train_.optimizer.kind)
    config_.fail("train.optimizer",
                 fmt::format("is {} but {} was saved with {}: its optimizer state ({}) does not fit {}; resume with "
                             "train.optimizer: {}, or export the checkpoint (moetrain export) and start a new run "
                             "from it with model.init_from (fresh optimizer state)", train_.optimizer.kind, dir,
                             saved_optimizer, saved_optimizer == "muon" ? "Muon's momentum and AdamW's moments"
                                                                        : "AdamW's moments",
                             train_.optimizer.kind, saved_optimizer));
  std::vector<std::string> changed;
  for (const KeySpec& spec : config_schema()) {
    const std::string before = saved->value_yaml(spec.key), now = config_.value_yaml(spec.key);
    if (before != now) changed.push_back(fmt::format("{}: {} -> {}", spec.key, before, now));
  }
  if (changed.empty()) return;
  if (dist_.root()) {
    spdlog::info("resume: {} key{} changed since {} was saved:", changed.size(), changed.size() == 1 ? "" : "s", dir);
    for (const std::string& c : changed) spdlog::info("  {}", c);
  }
  const LrSchedule before = lr_schedule_of(*saved), now = train_.schedule;
  const int64_t last = std::max(before.max_steps, now.max_steps);
  for (int64_t s = step; s < last; ++s) {
    const double a = before.at(s), b = now.at(s);
    if (a == b) continue;
    const std::string what = fmt::format(
        "the learning-rate schedule changed: at step {} the lr would be {:.4g} instead of {:.4g} (the saved run's "
        "schedule: {} steps, warmup {}, lr {:.4g}; this config's: {} steps, warmup {}, lr {:.4g})", s + 1, b, a,
        before.max_steps, before.warmup_steps, before.lr, now.max_steps, now.warmup_steps, now.lr);
    if (config_.get_string("ckpt.schedule_change") != "apply")
      config_.fail("ckpt.schedule_change", what + "; set ckpt.schedule_change: apply to continue on the new "
                                                  "schedule, or resume with the saved values (" +
                                                  checkpoint_config_path(dir) + ")");
    if (dist_.root()) spdlog::warn("resume: {}; applied (ckpt.schedule_change: apply)", what);
    return;
  }
}

void Trainer::resume() {
  // The root decides from the run directory; every rank loads what it needs of that checkpoint.
  StartPlan plan;
  Tensor chosen = full({1}, -1, DType::i64);
  if (dist_.root()) {
    plan = run_->plan(ckpt_, config_);
    if (plan.from) chosen.data<int64_t>()[0] = plan.from->step;
  }
  if (dist_.size() > 1) dist_.world->broadcast(chosen, 0);
  if (const int64_t step = chosen.data<int64_t>()[0]; step >= 0) {
    const std::string dir = (std::filesystem::path(checkpoints_dir(ckpt_.run_dir)) / checkpoint_name(step)).string();
    check_config_changes(dir, step);
    const auto t0 = Clock::now();
    progress_ = load_checkpoint(dist_, dir, *model_, opt_.get(), config_);
    stream_->set_state(progress_.loader);
    spdlog::info("resumed from {} (step {}, {} tokens seen, {} skipped steps) in {:.2f} s", dir, progress_.step,
                 with_commas(progress_.tokens), progress_.skipped, seconds_since(t0));
  }
  place_on_device();
  setup_cuda_graph();
  // The last safe point before anything is written: every rank agrees (a signal may have reached one).
  if (const signals::Stop stop = stop_requested(); stop != signals::Stop::none) {
    signals::throw_if_requested("before training started");
    throw Interrupted(fmt::format("interrupted by a stop signal on another rank before training started; nothing "
                                  "was written (exit code {})", signals::exit_code(stop)), signals::exit_code(stop));
  }
  begin_run(plan);
}

// train.device = cuda: parameters and moments move to the GPU after a resume has
// loaded them on the host; batches follow them each step.
void Trainer::place_on_device() {
  ParameterList& params = model_->parameters();
  if (train_.cuda) {
    if (cuda::device_count() == 0)
      config_.fail("train.device", "is cuda but no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), "
                                   "or set train.device: cpu");
    device_ = Device{DeviceKind::cuda, cuda::select_device(cpu::launcher_local_rank())};
    cuda::set_allow_tf32(train_.tf32);
    // The chunked KDA's state products on TF32 tensor cores (ops/kda/kda_tc.h): with
    // train.tf32, and in bf16 runs, whose KDA gets f32 inputs (the layer computes
    // its gates and state in f32) and whose other products are bf16 already.
    cuda::set_kda_tensor_cores(train_.tf32 || train_.mixed_precision);
    for (const NamedParameter& p : params) move_to_device_(p.tensor, device_);
    for (const std::string& name : opt_->slot_names())
      for (size_t i = 0; i < params.size(); ++i)
        if (const Tensor t = opt_->slot(name, i); t.defined()) move_to_device_(t, device_);
    spdlog::info("training on {} ({})", device_, cuda::device_name(device_.index));
    // train.profile: times on the GPU, between CUDA events (docs/training.md), not the host's launch times.
    if (train_.profile) profile::set_device_clock(cuda::event_clock(device_.index));
  }
  if (!train_.mixed_precision) return;
  // Parameters become bf16 on the device; the optimizer keeps their f32 values as
  // master weights (what checkpoints and the exported model hold).
  opt_->convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
  int64_t kept = 0;
  for (const NamedParameter& p : params) kept += p.tensor.dtype() == DType::f32 ? p.tensor.numel() : 0;
  spdlog::info("mixed precision: bf16 parameters and activations, f32 master weights and optimizer state; {} of {} "
               "parameters stay f32 (router, KDA gate, conv and output norm)", with_commas(kept),
               with_commas(count_parameters(params)));
  if (!device_.is_cuda() && !cpu::onednn::has_bf16_kernels())
    spdlog::warn("bf16 on this CPU: oneDNN has no bf16 matmul at ISA {} (below AVX-512), so the products widen to f32 "
                 "and the bf16 step is slower than an f32 one; train.dtype: f32 is faster here (docs/performance.md)",
                 cpu::onednn::effective_isa());
}

// The root makes the start durable (run directory, resolved config) and opens the metrics.
void Trainer::begin_run(const StartPlan& plan) {
  if (dist_.root()) {
    run_->begin(plan);
    config_.save((std::filesystem::path(ckpt_.run_dir) / "config.resolved.yaml").string());
    metrics_ = std::make_unique<MetricsWriter>(run_->metrics_path(), run_->run_id());
    save_options_.run_id = run_->run_id();
    save_options_.lineage = plan.lineage;
    spdlog::info("run id {} (lineage {}{})", run_->run_id(), plan.lineage,
                 plan.from ? ", from " + plan.from->name : std::string(", from step 0"));
  }
  start_step_ = progress_.step;
  start_tokens_ = progress_.tokens;
  last_.step = progress_.step;
  model_flops_per_token_ = model_->flops_per_token(train_.seq_len);
  const double told = config_.get_number("train.peak_tflops") * 1e12;
  peak_flops_ = told > 0 ? told : measured_gemm_flops(device_, model_->dtype());
  if (dist_.root())
    spdlog::info("  MFU below is model FLOPs / {:.3g} TFLOP/s per rank ({})", peak_flops_ / 1e12,
                 told > 0 ? "train.peak_tflops"
                          : fmt::format("measured: a 1024^3 {} matrix product on {}, {} threads; set "
                                        "train.peak_tflops to use a datasheet peak", model_->dtype(), device_,
                                        cpu::num_threads()));
  run_start_ = Clock::now();
  if (progress_.step > 0 && done())
    spdlog::info("the checkpoint is at step {}, train.max_steps: nothing left to train; the model is written from it",
                 progress_.step);
}

StepResult Trainer::train_step() {
  const auto t0 = Clock::now();
  StepResult r;
  r.step = progress_.step + 1;
  // train.profile: components timed from the second step of this run on (the first
  // allocates its buffers); eval, samples and checkpoints are not counted.
  if (train_.profile && progress_.step > start_step_) {
    profile::set_enabled(true);
    step_launches_from_ = launch_counts();
  }
  comm::set_watchdog_step(r.step);
  faults_.at_step_start(r.step);
  r.lr = train_.schedule.at(progress_.step);
  {
    profile::Region region("optimizer");
    opt_->zero_grad();
  }
  const double local_loss = forward_backward(r.step);
  {
    profile::Region region("grad sync+clip");
    r.loss = mean_loss(dist_, local_loss);
    r.grad_norm = reduce_gradients();
  }
  // Non-finite values reach every rank through the loss mean and the gradient
  // sums (the norm of expert shards is summed over the ep group), so every rank
  // takes the same decision here without another collective.
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm))
    return skip(std::move(r), fmt::format("loss {}, gradient norm {}", r.loss, r.grad_norm));
  if (std::optional<std::string> problem = update_problem(r.lr)) return skip(std::move(r), *problem);
  progress_.consecutive_skips = 0;
  streak_loss_non_finite_ = false;
  r.moe = update(r.lr, r.qk);
  end_step(r, t0);
  return r;
}

// Gradients summed over the ranks that share each parameter, then clipped by the
// global norm (returned, before clipping).
double Trainer::reduce_gradients() {
  sync_gradients(dist_, *model_);
  return clip_grad_norm(dist_, *model_, train_.grad_clip);
}

// This replica's next micro-batch: replica q (the rank's index in its stage; the
// rank at pp = 1) takes batch q of every `replicas` consecutive ones of the stream.
data::Batch Trainer::next_batch() {
  profile::Region region("data");
  data::Batch batch;
  for (int r = 0; r < dist_.grid.replicas(); ++r) {
    data::Batch b = stream_->next();
    if (r == dist_.grid.local_index()) batch = std::move(b);
  }
  return batch;
}

DType Trainer::activation_dtype() const { return train_.mixed_precision ? DType::bf16 : model_->dtype(); }

// The micro-batches of one step (gradient accumulation): this rank's share of the
// stream is batches rank, rank + world, ... Returns this rank's mean loss (under
// pp: the last stage's; 0 on the others).
double Trainer::forward_backward(int64_t step) {
  if (dist_.grid.pp > 1) {
    std::vector<data::Batch> batches;
    for (int64_t micro = 0; micro < train_.grad_accum; ++micro) batches.push_back(next_batch());
    const PipelineStepResult r = pipeline_train_step(dist_, *model_, batches, device_, activation_dtype());
    faults_.after_backward(step, model_->parameters());
    return r.loss_sum / static_cast<double>(train_.grad_accum);
  }
  // No wait for the GPU until the step's loss is read, once, after the last
  // backward (docs/cuda.md, "Host synchronisation"): the batch stays on the host
  // (the embedding and the loss move what they need and keep the host copies for
  // their checks), and the micro-batch losses are summed where they are. With a CUDA
  // graph (train.cuda_graph), the batch goes into the graph's input buffers instead.
  std::vector<data::Batch> batches;
  for (int64_t micro = 0; micro < train_.grad_accum; ++micro) batches.push_back(next_batch());
  Tensor loss_sum;
  if (graph_step_) {
    loss_sum = graph_step_->run(batches, progress_.step > start_step_);
  } else {
    std::vector<Tensor> ids, targets;
    for (const data::Batch& b : batches) {
      ids.push_back(b.inputs);
      targets.push_back(b.targets);
    }
    loss_sum = micro_batches(ids, targets, step, true);
  }
  faults_.after_backward(step, model_->parameters());
  return loss_sum.item<double>() / static_cast<double>(train_.grad_accum);
}

Tensor Trainer::micro_batches(const std::vector<Tensor>& ids, const std::vector<Tensor>& targets, int64_t step,
                              bool overlap) {
  Tensor loss_sum;
  const int64_t n = static_cast<int64_t>(ids.size());
  for (int64_t micro = 0; micro < n; ++micro) {
    Tensor loss = model_->loss(ids[static_cast<size_t>(micro)], targets[static_cast<size_t>(micro)], true);
    {
      NoGradGuard no_grad;
      const Tensor l = loss.detach().to(DType::f64);
      loss_sum = loss_sum.defined() ? add(loss_sum, l) : l;
    }
    // The last micro-batch's backward sums finished gradient buckets as it goes
    // (train.overlap_grad_sync); not on a fault-injection step, whose NaN is
    // written after backward (every rank knows the step, so all agree).
    std::unique_ptr<autograd::GradReadyHookGuard> overlapped;
    if (overlap && micro == n - 1 && !faults_.corrupts_gradients(step))
      overlapped = begin_overlapped_grad_sync(dist_, *model_);
    (n > 1 ? mul_scalar(loss, 1.0 / static_cast<double>(n)) : loss).backward();
  }
  return loss_sum;
}

// train.cuda_graph: on one GPU, from the run's second step, the forward and backward
// replayed from a CUDA graph (train/graph_step.h); else every step eager.
void Trainer::setup_cuda_graph() {
  const CudaGraphMode mode = parse_cuda_graph_mode(train_.cuda_graph);
  if (mode == CudaGraphMode::off || !train_.cuda) return;  // on with the CPU or train.profile: refused by the options
  std::string why_not;
  if (dist_.size() > 1) why_not = fmt::format("the run has {} ranks (graphs are captured on one GPU)", dist_.size());
  else if (train_.profile) why_not = "train.profile times each component eagerly";
  if (why_not.empty()) {
    graph_step_ = std::make_unique<GraphStep>(
        *model_, device_, mode,
        [this](const std::vector<Tensor>& ids, const std::vector<Tensor>& targets) {
          return micro_batches(ids, targets, progress_.step + 1, false);
        });
    return;
  }
  if (mode == CudaGraphMode::on)
    config_.fail("train.cuda_graph", "captures on one GPU only, but " + why_not + "; set it to auto or off");
  if (dist_.root()) spdlog::info("train.cuda_graph auto: every step eager: {}", why_not);
}

// train.nan_policy: a step that would not be finite changes nothing (no update, no
// router-bias move) and is counted; a run of them, or any with abort, ends the job.
StepResult Trainer::skip(StepResult r, std::string why) {
  ++progress_.skipped;
  ++progress_.consecutive_skips;
  if (!std::isfinite(r.loss)) streak_loss_non_finite_ = true;
  const std::string what = fmt::format("step {}: {}", r.step, why);
  if (train_.abort_on_nan)
    throw NumericalError(fmt::format("{} (train.nan_policy = abort); lower train.lr (now {}) or check the data", what,
                                     train_.schedule.lr));
  if (progress_.consecutive_skips > train_.max_consecutive_skips)
    throw NumericalError(fmt::format("{}: {} steps in a row were not finite (train.max_consecutive_skips = {}); "
                                     "lower train.lr (now {}) or check the data", what, progress_.consecutive_skips,
                                     train_.max_consecutive_skips, train_.schedule.lr));
  spdlog::warn("{}: step skipped on every rank (train.nan_policy = skip; {} skipped so far)", what, progress_.skipped);
  profile::set_enabled(false);
  opt_->zero_grad();
  reset_moe_stats(*model_);
  model_->reset_max_logits();  // a skipped step's logits do not count towards the next step's
  r.skipped = true;
  r.skip_reason = std::move(why);
  progress_.step = r.step;
  return r;
}

// train.check_update: what would not stay finite if the optimizer updated now, on any rank
// (expert shards differ between ranks: one tiny all-reduce agrees), or nullopt.
std::optional<std::string> Trainer::update_problem(double lr) {
  if (!train_.check_update) return std::nullopt;
  std::optional<NonFiniteTensor> bad;
  {
    profile::Region region("update check");
    bad = opt_->non_finite_update(lr);
  }
  int ranks_with_problem = bad ? 1 : 0;
  if (dist_.size() > 1) {
    Tensor flag = full({1}, ranks_with_problem, DType::i32);
    dist_.world->all_reduce_sum(flag);
    ranks_with_problem = flag.data<int32_t>()[0];
  }
  if (ranks_with_problem == 0) return std::nullopt;
  // train.zero 1: the count is of the elements this rank updates, not the whole tensor's.
  return bad ? fmt::format("the update (lr {:.3g}) would make {}{}", lr, describe(*bad),
                           opt_->sharded() ? " (counted in the part of it this rank updates, train.zero 1)" : "")
             : fmt::format("the update (lr {:.3g}) would make values non-finite on {} other rank{}", lr,
                           ranks_with_problem, ranks_with_problem == 1 ? "" : "s");
}

// The router biases from this step's assignments (summed over the ranks), then the optimizer.
MoeStepSummary Trainer::update(double lr, QkClipSummary& qk) {
  all_reduce_moe_stats(dist_, *model_);
  MoeStepSummary moe = moe_step(*model_);
  profile::Region region("optimizer");
  opt_->step(lr);
  // QK-Clip on the owned elements, before the all-gather spreads them.
  if (train_.qk_clip) qk = apply_qk_clip(dist_, *model_, *opt_, train_.qk_clip_tau);
  gather_parameters(dist_, *model_);  // train.zero 1: every rank updated its part
  return moe;
}

void Trainer::end_step(StepResult& r, Clock::time_point t0) {
  if (profile::enabled()) {
    profile::set_enabled(false);  // what follows (logging, eval, checkpoints) is not a step's work
    ++profiled_steps_;
    profiled_launches_ = profiled_launches_ + (launch_counts() - step_launches_from_);
  }
  r.seconds = seconds_since(t0);
  r.tokens = train_.tokens_per_step(dist_.grid.replicas());
  progress_.tokens += r.tokens;
  progress_.step = r.step;
  last_ = r;
}

void Trainer::record(const StepResult& r) {
  if (run_) run_->check_held();  // before this step's metrics (and its checkpoint, below in train())
  if (r.skipped) {
    if (metrics_) metrics_->write({{"step", r.step}, {"skipped", true}, {"skipped_steps", progress_.skipped}});
    return;
  }
  const double tok_s = static_cast<double>(r.tokens) / r.seconds;
  // Smoothed: an exponential average of the step time (weight 0.1), restarted at this
  // run's second step so the first (allocations, warm-up) does not linger in it.
  const int64_t run_steps = r.step - start_step_;
  step_seconds_avg_ = run_steps <= 2 ? r.seconds : 0.9 * step_seconds_avg_ + 0.1 * r.seconds;
  const double tok_s_avg = static_cast<double>(r.tokens) / step_seconds_avg_;
  const double mfu = peak_flops_ > 0 ? model_flops_per_token_ * tok_s_avg / dist_.size() / peak_flops_ : 0.0;
  const double elapsed = seconds_since(run_start_);
  const double eta = static_cast<double>(train_.max_steps - r.step) * step_seconds_avg_;
  if (r.step % train_.log_every == 0 || r.step == 1 || r.step == train_.max_steps)
    spdlog::info("step {}/{} | loss {:.4f} | lr {:.1e} | gnorm {:.2f} | {} tok/s | {:.0f} ms | MFU {:.1f}% | {} "
                 "elapsed, ETA {}{}{}", r.step, train_.max_steps, r.loss, r.lr, r.grad_norm,
                 with_commas(std::llround(tok_s_avg)), r.seconds * 1e3, 100 * mfu, clock_text(elapsed),
                 clock_text(eta),
                 r.moe.fields.empty()
                     ? std::string()
                     : fmt::format(" | moe max/mean {:.2f}, {} dead{}", r.moe.worst_max_over_mean, r.moe.dead,
                                   r.moe.dropped ? fmt::format(", {} dropped", r.moe.dropped) : std::string()),
                 !r.qk.recorded ? std::string()
                                : fmt::format(" | max logit {:.3g}{}", r.qk.max_logit,
                                              r.qk.clipped_heads ? fmt::format(", {} heads clipped", r.qk.clipped_heads)
                                                                 : std::string()));
  std::vector<std::pair<std::string, MetricsWriter::Value>> record{
      {"step", r.step}, {"loss", r.loss}, {"lr", r.lr}, {"grad_norm", r.grad_norm}, {"tok_per_s", tok_s},
      {"tok_per_s_avg", tok_s_avg}, {"mfu", mfu}, {"step_ms", r.seconds * 1e3}, {"tokens", progress_.tokens},
      {"elapsed_s", elapsed}};
  if (progress_.skipped > 0) record.emplace_back("skipped_steps", progress_.skipped);
  if (device_.is_cuda())  // the caching allocator's peak: what the GPU had to hold
    record.emplace_back("gpu_peak_reserved_bytes", cuda::memory_stats(device_.index).peak_reserved_bytes);
  record.insert(record.end(), r.moe.fields.begin(), r.moe.fields.end());
  if (r.qk.recorded) {  // train.qk_clip: the step's largest logit, per layer (this rank's stage) and overall
    record.emplace_back("max_logit", r.qk.max_logit);
    record.emplace_back("qk_clipped_heads", r.qk.clipped_heads);
    for (const auto& [layer, value] : r.qk.layers) record.emplace_back("max_logit_" + layer, value);
  }
  if (metrics_) metrics_->write(record);
  if (r.step != 1) return;
  spdlog::info("  peak memory after the first step: {}", human_bytes(peak_rss_bytes()));
  if (device_.is_cuda()) {
    const cuda::MemoryStats m = cuda::memory_stats(device_.index);
    spdlog::info("  {} memory after the first step: {} peak in tensors, {} peak reserved", device_,
                 human_bytes(static_cast<double>(m.peak_allocated_bytes)),
                 human_bytes(static_cast<double>(m.peak_reserved_bytes)));
  }
}

EvalResult Trainer::evaluate() {
  EvalResult e;
  const int64_t step = progress_.step;
  if (data_.synthetic) {  // every rank, the same held-out rows
    const AnswerScore a = evaluate_answers(whole_model(), data_.task, train_.batch_size, train_.eval_batches,
                                           train_.seed + kHeldOutSeed);
    spdlog::info("step {}/{} | val loss {:.4f} | val acc {:.4f} ({} answers)", step, train_.max_steps, a.loss,
                 a.accuracy, a.answers);
    if (metrics_) metrics_->write({{"step", step}, {"val_loss", a.loss}, {"val_acc", a.accuracy}});
    e = {a.loss, a.accuracy, a.answers};
  } else if (val_loader_) {
    val_loader_->set_state({});  // always the same windows, from the start of the data
    e.loss = moetrain::evaluate(whole_model(), *val_loader_, train_.eval_batches);  // every rank, the same windows
    spdlog::info("step {}/{} | val loss {:.4f}", step, train_.max_steps, e.loss);
    if (metrics_) metrics_->write({{"step", step}, {"val_loss", e.loss}});
  }
  last_eval_ = e;
  return e;
}

void Trainer::sample() {
  if (!tokenizer_) return;
  std::vector<int32_t> prompt = tokenizer_->encode(train_.sample_prompt);
  if (prompt.empty()) prompt.push_back(tokenizer_->eot_token().value_or(0));
  GenerateStats stats;
  const std::string text = tokenizer_->decode(generate(whole_model(), prompt, train_.sample, &stats));
  // The log is for people (a terminal, a job's log file): no raw control bytes or broken UTF-8.
  spdlog::info("sample at step {}:\n{}", progress_.step, data::printable_text(train_.sample_prompt + text));
  if (stats.stopped_at_context)
    spdlog::warn("the sample stopped at the model's context ({} positions) before train.sample_tokens = {}; lower "
                 "train.sample_tokens to {} or less", model_->max_positions(), train_.sample.max_new_tokens,
                 max_new_tokens_in_context(model_->max_positions(), static_cast<int64_t>(prompt.size())));
}

void Trainer::save() {
  if (run_) run_->check_held();
  progress_.loader = stream_->state();
  log_saved(saver_->save(*model_, *opt_, progress_, faults_.save_options(progress_.step, save_options_)));
  last_saved_step_ = progress_.step;
}

void Trainer::poll_saves() {
  if (saver_->async()) log_saved(saver_->poll());  // commits a background save once every rank wrote its file
}

void Trainer::log_saved(const std::optional<SaveResult>& saved) {
  if (saved && saver_->async())
    spdlog::info("checkpoint {} committed {:.2f} s after it began (written in the background; {} in this rank's "
                 "file)", saved->dir, saved->seconds, human_bytes(static_cast<double>(saved->bytes)));
  else if (saved)
    spdlog::info("checkpoint {} saved in {:.2f} s ({} in this rank's file, {:.0f} MB/s)", saved->dir, saved->seconds,
                 human_bytes(static_cast<double>(saved->bytes)), saved->bytes / 1e6 / std::max(saved->seconds, 1e-9));
}

// Which ranks were asked to stop (a signal may reach only some, or reach them in
// different steps): every rank takes the same decision.
signals::Stop Trainer::stop_requested() {
  const signals::Stop mine = signals::requested();
  if (dist_.size() == 1) return mine;
  Tensor asked = zeros({2}, DType::i32);  // ranks asked to save and exit, ranks preempted
  if (mine != signals::Stop::none) asked.data<int32_t>()[mine == signals::Stop::preempted ? 1 : 0] = 1;
  dist_.world->all_reduce_sum(asked);
  return asked.data<int32_t>()[1] > 0   ? signals::Stop::preempted
         : asked.data<int32_t>()[0] > 0 ? signals::Stop::save_and_exit
                                        : signals::Stop::none;
}

TrainSummary Trainer::stop(signals::Stop stop) {
  const std::string by = signals::first_signal() ? signals::name(signals::first_signal())
                         : stop == signals::Stop::preempted ? "a stop signal on another rank"
                                                            : "SIGUSR1 on another rank";
  spdlog::warn("{}: saving a checkpoint at step {} and exiting", by, progress_.step);
  if (last_saved_step_ != progress_.step) save();
  report_end();  // commits an asynchronous save
  TrainSummary s = summary();
  s.exit_code = signals::exit_code(stop);
  spdlog::info("stopped by {} after step {}; the checkpoint is committed; continue with ckpt.resume: auto (exit code "
               "{})", by, progress_.step, s.exit_code);
  return s;
}

void Trainer::report_end() {
  log_saved(saver_->finish());  // a background save still in flight
  if (progress_.tokens > start_tokens_) report_memory(dist_, *ledger_, baseline_rss_);  // steps ran here
  if (!train_.profile) return;
  profile::set_enabled(false);
  if (profiled_steps_ > 0) {
    spdlog::info("time per step by component (train.profile; this rank, mean of {} steps after the first):\n{}",
                 profiled_steps_, profile::format_table(profile::entries(), profiled_steps_));
    spdlog::info("launches per step (train.profile; this rank, mean of {} steps): {}", profiled_steps_,
                 format_launches_per_step(profiled_launches_, profiled_steps_, device_.is_cuda()));
  } else
    spdlog::info("train.profile: no step after the first ran here, nothing to report");
}

TrainSummary Trainer::summary() const {
  TrainSummary s;
  s.steps = progress_.step;
  s.last_train_loss = last_.loss;
  s.last_val_loss = last_eval_.loss;
  s.last_val_acc = last_eval_.accuracy;
  const double seconds = seconds_since(run_start_);
  if (progress_.tokens > start_tokens_ && seconds > 0)
    s.tokens_per_second = static_cast<double>(progress_.tokens - start_tokens_) / seconds;
  return s;
}

TrainSummary Trainer::finish() {
  report_end();
  const std::filesystem::path model_dir = std::filesystem::path(ckpt_.run_dir) / "model";
  // The run ends inside a streak of skipped steps (a diverged run that reached
  // max_steps before max_consecutive_skips), and in that streak the model's loss
  // itself was not finite: skipped steps change no weight, so the model as it stands
  // computes NaN or infinities and is not published. A streak of finite losses (a
  // bad gradient or update) leaves a usable model. A checkpoint that ends in a streak
  // with no step run here cannot show its loss is finite: refused too. Every rank
  // knows the same counts and losses, so all stop here.
  const bool trained_here = progress_.step > start_step_;
  if (progress_.consecutive_skips > 0 && (streak_loss_non_finite_ || !trained_here))
    throw NumericalError(fmt::format(
        "the run reached train.max_steps = {} inside a run of {} skipped step{} (train.nan_policy = skip){}, so no "
        "model is written to {}{}; lower train.lr (now {}), check model.init_std and the data, or export an earlier "
        "checkpoint", train_.max_steps, progress_.consecutive_skips, progress_.consecutive_skips == 1 ? "" : "s",
        trained_here ? " in which the model's loss was not finite"
                     : ", saved in the checkpoint it starts from; no step ran here to show the model's loss is finite",
        model_dir.string(), std::filesystem::exists(model_dir) ? " (the one there is an earlier run's)" : "",
        train_.schedule.lr));
  if (train_.sample_every > 0 || train_.max_steps == 0) sample();
  if (run_) run_->check_held();
  // The model directory is built aside and renamed into place, its config.resolved.yaml included.
  if (dist_.grid.ep > 1 || dist_.grid.pp > 1 || train_.mixed_precision) {
    // Collective: experts from the whole ep group, the stages' parameters from the
    // whole pipeline; under mixed precision the f32 master weights.
    const ParameterList state = full_state(dist_, *model_, train_.mixed_precision ? opt_.get() : nullptr);
    if (dist_.root()) export_model(*model_, model_dir.string(), &state, &config_);
  } else if (dist_.root()) {
    export_model(*model_, model_dir.string(), nullptr, &config_);
  }
  const TrainSummary s = summary();
  spdlog::info("done: {} steps ({} in this run, {:.1f} s, {} tok/s); model written to {}", s.steps,
               s.steps - start_step_, seconds_since(run_start_), with_commas(std::llround(s.tokens_per_second)),
               model_dir.string());
  return s;
}

TrainSummary train(const Config& config) {
  Trainer trainer(config);
  trainer.resume();
  while (!trainer.done()) {
    const StepResult r = trainer.train_step();
    trainer.record(r);
    if (!r.skipped && trainer.eval_due()) trainer.evaluate();
    if (!r.skipped && trainer.sample_due()) trainer.sample();
    trainer.poll_saves();
    if (trainer.checkpoint_due()) trainer.save();
    const signals::Stop stop = trainer.stop_requested();
    if (stop != signals::Stop::none && !trainer.done()) return trainer.stop(stop);
  }
  return trainer.finish();
}

}  // namespace moetrain
