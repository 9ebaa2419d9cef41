#include "train/distributed.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "core/grad_mode.h"
#include "nn/hybrid.h"
#include "optim/adamw.h"

namespace moetrain {

namespace {

// Expert shards differ between the ranks of an ep group; everything else is replicated.
bool sharded(const Distributed& d, const NamedParameter& p) { return d.grid.ep > 1 && p.group == "experts"; }

// The last stage's copy of a tied embedding table (the first stage's counts as the parameter).
bool tied_copy(const Distributed& d, const NamedParameter& p) {
  return d.tied_pipeline && d.grid.last_stage() && p.group == "embedding";
}

// What comm's gradient sums take: each parameter's name and tensor.
comm::GradTensors grad_tensors(const ParameterList& params) {
  comm::GradTensors out;
  out.reserve(params.size());
  for (const NamedParameter& p : params) out.push_back({p.name, p.tensor});
  return out;
}

void split(const Distributed& d, const ParameterList& params, ParameterList& replicated, ParameterList& shards) {
  for (const NamedParameter& p : params) (sharded(d, p) ? shards : replicated).push_back(p);
}

}  // namespace

Distributed make_distributed(const Config& config) {
  Distributed d;
  d.world = &comm::world();
  const int64_t ep = config.get_int("train.ep"), pp = config.get_int("train.pp");
  const bool hybrid = config.get_string("model.arch") == "hybrid";
  if (pp > 1 && !hybrid) config.fail("train.pp", "pipeline parallelism needs model.arch hybrid");
  if (d.world->size() % pp != 0)
    config.fail("train.pp",
                fmt::format("does not divide the {} ranks of this run (world = pp x dp x ep)", d.world->size()));
  if (d.world->size() / pp % ep != 0)
    config.fail("train.ep", fmt::format("does not divide the {} ranks of {} (world = pp x dp x ep)",
                                        d.world->size() / pp, pp > 1 ? "a pipeline stage" : "this run"));
  if (pp > 1) {
    const int64_t layers = HybridConfig::from(config).n_layer();
    if (pp > layers)
      config.fail("train.pp", fmt::format("exceeds the model's {} layers (each stage needs at least one)", layers));
    d.tied_pipeline = config.get_bool("model.tie_embeddings");
  }
  const int64_t experts = hybrid ? config.get_int("model.moe.num_experts") : 0;
  if (ep > 1 && experts == 0)
    config.fail("train.ep", "expert parallelism needs MoE layers (model.moe.num_experts > 0)");
  if (ep > 1 && experts % ep != 0)
    config.fail("train.ep", fmt::format("does not divide model.moe.num_experts = {}", experts));
  const double timeout_s = config.get_number("dist.timeout_s");
  if (timeout_s > 0 && d.world->size() > 1)
    d.watchdog = std::make_unique<comm::Watchdog>(comm::WatchdogOptions{
        .timeout_s = timeout_s, .rank = d.rank(), .size = d.size(), .host = d.world->host(), .on_timeout = {}});
  d.overlap_grad_sync = config.get_bool("train.overlap_grad_sync");
  if (pp > 1 && d.overlap_grad_sync && d.world->rank() == 0)
    spdlog::warn("{}: train.overlap_grad_sync has no effect under train.pp = {}: the gradient sums run after the "
                 "pipeline's last backward", config.where("train.overlap_grad_sync"), pp);
  const double bucket_mb = config.get_number("train.grad_bucket_mb");
  d.grad_bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20)));
  comm::WatchdogLabel label("process grid");
  d.grid = comm::make_process_grid(*d.world, static_cast<int>(ep), "train.ep", static_cast<int>(pp), "train.pp");
  return d;
}

comm::Communicator& replica_group(Distributed& d) { return d.grid.pp > 1 ? *d.grid.stage_group : *d.world; }

void log_rank_table(Distributed& d, int threads) {
  // Host name (64 bytes) and thread count of every rank, gathered as i32 rows.
  constexpr int kHost = 64;
  Tensor row = zeros({1, kHost + 1}, DType::i32);
  int32_t* p = row.data<int32_t>();
  const std::string host = d.world->host();
  for (size_t i = 0; i < host.size() && i < kHost; ++i) p[i] = static_cast<unsigned char>(host[i]);
  p[kHost] = threads;
  comm::WatchdogLabel label("rank table");
  Tensor all = d.world->all_gather(row);
  if (!d.root()) return;
  const comm::ProcessGrid& g = d.grid;
  if (g.pp > 1)
    spdlog::info("{} rank(s): pp {} x dp {} x ep {}", d.size(), g.pp, g.dp, g.ep);
  else
    spdlog::info("{} rank(s): dp {} x ep {}", d.size(), g.dp, g.ep);
  const int32_t* a = all.data<int32_t>();
  const int per_stage = g.dp * g.ep;
  for (int r = 0; r < d.size(); ++r) {
    std::string h;
    for (int i = 0; i < kHost && a[r * (kHost + 1) + i] != 0; ++i) h += static_cast<char>(a[r * (kHost + 1) + i]);
    const int local = r % per_stage;
    spdlog::info("  rank {:>3} | host {} | {}dp {} ep {} | {} threads", r, h,
                 g.pp > 1 ? fmt::format("pp {} ", r / per_stage) : std::string(), local / g.ep, local % g.ep,
                 a[r * (kHost + 1) + kHost]);
  }
}

void sync_gradients(Distributed& d, const LanguageModel& model) {
  if (d.size() == 1) return;
  if (d.reducer && d.reducer->in_step()) {
    comm::WatchdogLabel label("gradient sync (overlapped)");
    const comm::GradSyncStats stats = d.reducer->finish();
    if (d.root() && !d.overlap_logged)
      spdlog::info("overlapped gradient sync: {} buckets ({:.1f} MiB), {} started during backward on rank 0",
                   stats.num_buckets, static_cast<double>(stats.bytes) / (1 << 20), stats.num_started_early);
    d.overlap_logged = true;
    return;
  }
  ParameterList replicated, shards;
  split(d, model.parameters(), replicated, shards);
  comm::WatchdogLabel label("gradient sync");
  comm::GradSyncOptions o;
  o.scale = 1.0 / d.grid.replicas();
  o.bucket_bytes = d.grad_bucket_bytes;
  comm::all_reduce_grads(replica_group(d), grad_tensors(replicated), o);
  if (!shards.empty()) comm::all_reduce_grads(*d.grid.dp_group, grad_tensors(shards), o);
  if (d.tied_pipeline && d.grid.tied_group) {
    // Both copies of the tied table get the sum of the embedding's and the head's gradients.
    ParameterList table;
    for (const NamedParameter& p : model.parameters())
      if (p.group == "embedding") table.push_back(p);
    MT_ASSERT(table.size() == 1, "tied embeddings under pp: {} embedding tables on stage {}", table.size(),
              d.grid.pp_index);
    comm::WatchdogLabel tied("tied embedding gradient");
    comm::all_reduce_grads(*d.grid.tied_group, grad_tensors(table), {.scale = 1.0, .bucket_bytes = o.bucket_bytes});
  }
}

std::unique_ptr<autograd::GradReadyHookGuard> begin_overlapped_grad_sync(Distributed& d, const LanguageModel& model) {
  // Under pp the sums run after the pipeline's last backward (blocking).
  if (d.size() == 1 || !d.overlap_grad_sync || d.grid.pp > 1) return nullptr;
  if (!d.reducer) {
    // The same groups and scale as sync_gradients' blocking sums.
    std::vector<comm::ReducedParameter> params;
    for (const NamedParameter& p : model.parameters())
      params.push_back({{p.name, p.tensor}, sharded(d, p) ? d.grid.dp_group.get() : d.world});
    comm::GradSyncOptions o;
    o.scale = 1.0 / d.size();
    o.bucket_bytes = d.grad_bucket_bytes;
    d.reducer = std::make_unique<comm::GradReducer>(std::move(params), o);
  }
  d.reducer->begin();
  comm::GradReducer* reducer = d.reducer.get();
  return std::make_unique<autograd::GradReadyHookGuard>([reducer](const Tensor& leaf) {
    comm::WatchdogLabel label("gradient sync (during backward)");
    reducer->grad_ready(leaf);
  });
}

double clip_grad_norm(Distributed& d, const LanguageModel& model, double max_norm) {
  if (d.size() == 1) return moetrain::clip_grad_norm(model.parameters(), max_norm);
  ParameterList replicated, shards;
  split(d, model.parameters(), replicated, shards);
  std::erase_if(replicated, [&](const NamedParameter& p) { return tied_copy(d, p); });  // counted once, on stage 0
  double total = grad_squared_sum(replicated);
  if (!shards.empty()) {
    Tensor s = full({1}, grad_squared_sum(shards), DType::f64);
    comm::WatchdogLabel label("gradient norm");
    d.grid.ep_group->all_reduce_sum(s);
    total += s.data<double>()[0];
  }
  if (d.grid.pp > 1) {  // the stages' sums
    Tensor s = full({1}, total, DType::f64);
    comm::WatchdogLabel label("gradient norm (pipeline)");
    d.grid.pipe_group->all_reduce_sum(s);
    total = s.data<double>()[0];
  }
  const double norm = std::sqrt(total);
  if (max_norm > 0 && norm > max_norm) scale_grads(model.parameters(), max_norm / (norm + 1e-6));
  return norm;
}

void all_reduce_moe_stats(Distributed& d, LanguageModel& model) {
  if (d.size() == 1) return;
  comm::WatchdogLabel label("MoE load counts");
  for (MoeLayer* m : model.moe_layers()) {
    MoeStats& st = m->stats();
    const int64_t E = static_cast<int64_t>(st.tokens_per_expert.size());
    Tensor t = empty({E + 1}, DType::f64);
    std::copy(st.tokens_per_expert.begin(), st.tokens_per_expert.end(), t.data<double>());
    t.data<double>()[E] = static_cast<double>(st.dropped);
    replica_group(d).all_reduce_sum(t);  // the ranks holding this layer
    std::copy(t.data<double>(), t.data<double>() + E, st.tokens_per_expert.begin());
    st.dropped = static_cast<int64_t>(t.data<double>()[E]);
  }
}

double mean_over_world(Distributed& d, double value) {
  if (d.size() == 1) return value;
  Tensor t = full({1}, value, DType::f64);
  comm::WatchdogLabel label("mean over the world");
  d.world->all_reduce_sum(t);
  return t.data<double>()[0] / d.size();
}

double mean_loss(Distributed& d, double value) {
  if (d.grid.pp == 1) return mean_over_world(d, value);
  Tensor t = full({1}, d.grid.last_stage() ? value : 0.0, DType::f64);
  comm::WatchdogLabel label("loss mean over the last stage");
  d.world->all_reduce_sum(t);
  return t.data<double>()[0] / d.grid.replicas();
}

namespace {

// Pipeline stages' full states to the root: a stage's first rank sends the list's
// names, groups, dtypes and shapes (one JSON text as i32 codes), then each tensor.
void send_state(comm::Communicator& world, const ParameterList& state, int to) {
  nlohmann::json meta = nlohmann::json::array();
  for (const NamedParameter& p : state)
    meta.push_back({{"name", p.name}, {"group", p.group}, {"decay", p.decay}, {"dtype", static_cast<int>(p.tensor.dtype())},
                    {"shape", p.tensor.shape().vec()}});
  const std::string text = meta.dump();
  Tensor length = full({1}, static_cast<double>(text.size()), DType::i64);
  Tensor codes = empty({static_cast<int64_t>(text.size())}, DType::i32);
  for (size_t i = 0; i < text.size(); ++i) codes.data<int32_t>()[i] = static_cast<unsigned char>(text[i]);
  std::vector<comm::P2POp> ops{{comm::P2POp::Kind::send, to, length}};
  world.send_recv(ops);
  ops = {{comm::P2POp::Kind::send, to, codes}};
  for (const NamedParameter& p : state) {
    Tensor t = p.tensor.detach();
    ops.push_back({comm::P2POp::Kind::send, to, t.is_cpu() ? t : t.to(kCpu)});
  }
  world.send_recv(ops);
}

ParameterList receive_state(comm::Communicator& world, int from) {
  Tensor length = empty({1}, DType::i64);
  std::vector<comm::P2POp> ops{{comm::P2POp::Kind::recv, from, length}};
  world.send_recv(ops);
  Tensor codes = empty({length.data<int64_t>()[0]}, DType::i32);
  ops = {{comm::P2POp::Kind::recv, from, codes}};
  world.send_recv(ops);
  std::string text(static_cast<size_t>(codes.numel()), '\0');
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>(codes.data<int32_t>()[i]);
  ParameterList out;
  ops.clear();
  for (const nlohmann::json& m : nlohmann::json::parse(text)) {
    Tensor t = empty(Shape(m.at("shape").get<std::vector<int64_t>>()), static_cast<DType>(m.at("dtype").get<int>()));
    out.push_back({m.at("name").get<std::string>(), t, m.at("decay").get<bool>(), m.at("group").get<std::string>()});
    ops.push_back({comm::P2POp::Kind::recv, from, t});
  }
  world.send_recv(ops);
  return out;
}

}  // namespace

ParameterList full_state(Distributed& d, const LanguageModel& model, const AdamW* opt) {
  ParameterList out;
  NoGradGuard no_grad;
  comm::WatchdogLabel label("expert gather");
  const ParameterList& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const NamedParameter& p = params[i];
    NamedParameter q = p;
    if (opt) q.tensor = opt->master_or_parameter(i);
    if (sharded(d, p)) q.tensor = d.grid.ep_group->all_gather(q.tensor.detach());
    out.push_back(q);
  }
  const ParameterList buffers = model.buffers();
  out.insert(out.end(), buffers.begin(), buffers.end());
  if (d.grid.pp == 1) return out;
  std::erase_if(out, [&](const NamedParameter& p) { return tied_copy(d, p); });  // stage 0 sends the table
  comm::WatchdogLabel stages("pipeline stages' state to the root");
  const int per_stage = d.grid.replicas();
  if (d.root()) {
    for (int s = 1; s < d.grid.pp; ++s) {
      ParameterList part = receive_state(*d.world, s * per_stage);
      out.insert(out.end(), part.begin(), part.end());
    }
  } else if (d.grid.local_index() == 0) {
    send_state(*d.world, out, 0);
  }
  return out;
}

}  // namespace moetrain
