#include "train/distributed.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "core/grad_mode.h"
#include "nn/model_family.h"
#include "optim/make_optimizer.h"

namespace moetrain {

namespace {

// Expert shards differ between the ranks of an ep group; everything else is replicated.
bool sharded(const Distributed& d, const NamedParameter& p) { return d.grid.ep > 1 && p.group == "experts"; }

// The last stage's copy of a tied embedding table (the first stage's counts as the parameter).
bool tied_copy(const Distributed& d, const NamedParameter& p) {
  return d.tied_pipeline && d.grid.last_stage() && p.group == "embedding";
}

// The parameters by replica_group (indices in list order), the groups of
// replicated parameters first, then those of expert shards: the order in which
// gradients are summed and the norm adds them.
struct ReplicaGroup {
  comm::Communicator* comm = nullptr;
  bool expert_shards = false;
  std::vector<size_t> params;
};
std::vector<ReplicaGroup> replica_groups(const Distributed& d, const ParameterList& params) {
  std::vector<ReplicaGroup> groups;
  for (bool experts : {false, true})
    for (size_t i = 0; i < params.size(); ++i) {
      if (sharded(d, params[i]) != experts) continue;
      comm::Communicator* c = replica_group(d, params[i]);
      auto it = std::find_if(groups.begin(), groups.end(), [&](const ReplicaGroup& g) { return g.comm == c; });
      if (it == groups.end()) it = groups.insert(groups.end(), ReplicaGroup{c, experts, {}});
      it->params.push_back(i);
    }
  return groups;
}

comm::GradTensors grad_tensors(const ParameterList& params, const std::vector<size_t>& members) {
  comm::GradTensors out;
  for (size_t i : members) out.push_back({params[i].name, params[i].tensor});
  return out;
}

std::vector<Tensor> grads(const ParameterList& params, const std::vector<size_t>& members) {
  std::vector<Tensor> out;
  for (size_t i : members) out.push_back(params[i].tensor.grad());
  return out;
}

// train.zero 1: the owned part of each grad of a zero group (undefined where none).
std::vector<Tensor> owned_grads(const comm::ZeroGroup& g, const ParameterList& params) {
  std::vector<Tensor> parts;
  const int me = g.comm->rank();
  for (size_t k = 0; k < g.params.size(); ++k) {
    const Tensor grad = params[g.params[k]].tensor.grad();
    const auto [a, b] = g.shards.owned(k, me);
    parts.push_back(grad.defined() && b > a ? alias(grad, Shape{b - a}, a) : Tensor());
  }
  return parts;
}

// The fold of the squares of a zero group's grads in list order, continued from
// `start`, rank after rank: rank k continues from rank k-1's running sum (a
// broadcast of one f64 from each rank that owns elements). Every rank returns
// the total.
double chained_squared_sum(const comm::ZeroGroup& g, const ParameterList& params, double start = 0) {
  const std::vector<Tensor> parts = owned_grads(g, params);
  const int me = g.comm->rank();
  double running = start;
  Tensor passed = zeros({1}, DType::f64);
  for (int k = 0; k < g.comm->size(); ++k) {
    if (g.shards.bounds[static_cast<size_t>(k)] == g.shards.bounds[static_cast<size_t>(k) + 1]) continue;  // owns none
    if (k == me) running = grad_squared_sum_from(running, parts);
    if (g.comm->size() == 1) break;
    passed.data<double>()[0] = running;
    g.comm->broadcast(passed, k);
    running = passed.data<double>()[0];
  }
  return running;
}

}  // namespace

comm::Communicator* replica_group(const Distributed& d, const NamedParameter& p) {
  if (sharded(d, p)) return d.grid.dp_group.get();
  return d.grid.pp > 1 ? d.grid.stage_group.get() : d.world;
}

std::vector<ElementRange> make_zero_shards(Distributed& d, const ParameterList& params,
                                           const OptimizerOptions& options) {
  d.zero_groups.clear();
  for (const ReplicaGroup& g : replica_groups(d, params))
    d.zero_groups.push_back(comm::ZeroGroup{g.comm, g.expert_shards, g.params, {}});
  std::vector<ElementRange> owned(params.size());
  for (comm::ZeroGroup& g : d.zero_groups) {
    std::vector<int64_t> numels, units;
    std::vector<double> costs;
    bool whole_matrices = false;
    for (size_t i : g.params) {
      const Tensor& t = params[i].tensor;
      numels.push_back(t.numel());
      const bool muon = uses_muon(options, params[i]);
      whole_matrices |= muon;
      units.push_back(muon && t.numel() > 0 ? t.size(-2) * t.size(-1) : 1);
      costs.push_back(update_cost(options, params[i]));
    }
    // AdamW alone: element ranges of equal size (the layout of every earlier zero 1 run).
    g.shards = whole_matrices ? comm::make_flat_shards(numels, g.comm->size(), units, costs)
                              : comm::make_flat_shards(numels, g.comm->size());
    for (size_t k = 0; k < g.params.size(); ++k) {
      const auto [a, b] = g.shards.owned(k, g.comm->rank());
      owned[g.params[k]] = {a, b};
    }
  }
  return owned;
}

comm::ParallelDims parallel_dims(const Config& config, int world) {
  comm::ParallelDegrees degrees;
  // The schema bounds these to [1, 2^31 - 1] (config/schema.cpp sizes_tensors).
  degrees.pp = static_cast<int>(config.get_int(degrees.pp_key));
  degrees.pp_virtual = static_cast<int>(config.get_int(degrees.pp_virtual_key));
  degrees.ep = static_cast<int>(config.get_int(degrees.ep_key));
  degrees.tp = static_cast<int>(config.get_int(degrees.tp_key));
  degrees.cp = static_cast<int>(config.get_int(degrees.cp_key));
  return comm::make_parallel_dims(world, degrees,
                                  [&config](const std::string& key, const std::string& message) { config.fail(key, message); });
}

Distributed make_distributed(const Config& config) {
  Distributed d;
  d.world = &comm::world();
  const ModelFamily& family = model_family(config);
  check_capabilities(config, family);  // train.pp, train.ep, recomputation the family cannot run
  const comm::ParallelDims dims = parallel_dims(config, d.world->size());
  const int64_t pp = dims.pp;
  check_parallel_fit(config, family);  // layers for the (virtual) stages, routed experts for train.ep
  if (pp > 1) d.tied_pipeline = family.ties_embeddings(config);
  // Virtual stages (docs/parallelism.md#interleaved-virtual-stages): the schedule runs micro-batches in groups of pp.
  if (dims.pp_virtual > 1 && config.get_int("train.grad_accum") % pp != 0)
    config.fail("train.grad_accum", fmt::format("= {} micro-batches is not a multiple of train.pp = {}: the "
                                                "interleaved schedule of train.pp_virtual = {} runs them in groups "
                                                "of pp", config.get_int("train.grad_accum"), pp, dims.pp_virtual));
  d.pp_virtual = dims.pp_virtual;
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
  const int64_t zero = config.get_int("train.zero");
  if (zero > 1)
    config.fail("train.zero", "is not supported yet: 0 keeps the optimizer state whole on every rank, 1 shards it over "
                              "the data-parallel replicas (ZeRO stage 1); gradients and parameters are not sharded");
  if (zero == 1 && d.tied_pipeline)
    config.fail("train.zero", "1 with train.pp > 1 and model.tie_embeddings is not supported yet (the two stages' "
                              "copies of the table would need the same shards); untie the embeddings or use zero 0");
  // One rank: nothing to shard; the optimizer keeps whole tensors (the same numbers).
  d.zero = d.world->size() > 1 ? static_cast<int>(zero) : 0;
  if (zero == 1 && d.zero == 0)
    spdlog::info("train.zero 1 with one rank: nothing to shard; the optimizer state stays whole");
  comm::WatchdogLabel label("process grid");
  d.grid = comm::make_process_grid(*d.world, dims);
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
  comm::GradSyncOptions o;
  o.scale = 1.0 / d.grid.replicas();
  o.bucket_bytes = d.grad_bucket_bytes;
  if (d.zero) {  // (tied embeddings under pp are refused at zero 1: make_distributed)
    comm::WatchdogLabel label("gradient sync (reduce-scatter)");
    const ParameterList& params = model.parameters();
    for (const comm::ZeroGroup& g : d.zero_groups) {
      comm::GradTensors members;
      for (size_t i : g.params) members.push_back({params[i].name, params[i].tensor});
      comm::reduce_scatter_grads(*g.comm, members, g.shards, o);
    }
    return;
  }
  comm::WatchdogLabel label("gradient sync");
  const ParameterList& params = model.parameters();
  for (const ReplicaGroup& g : replica_groups(d, params))
    comm::all_reduce_grads(*g.comm, grad_tensors(params, g.params), o);
  if (d.tied_pipeline && d.grid.tied_group) {
    // Both copies of the tied table get the sum of the embedding's and the head's gradients.
    std::vector<size_t> table;
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].group == "embedding") table.push_back(i);
    MT_ASSERT(table.size() == 1, "tied embeddings under pp: {} embedding tables on stage {}", table.size(),
              d.grid.pp_index);
    comm::WatchdogLabel tied("tied embedding gradient");
    comm::all_reduce_grads(*d.grid.tied_group, grad_tensors(params, table),
                           {.scale = 1.0, .bucket_bytes = o.bucket_bytes});
  }
}

std::unique_ptr<autograd::GradReadyHookGuard> begin_overlapped_grad_sync(Distributed& d, const LanguageModel& model) {
  // Under pp the sums run after the pipeline's last backward (blocking).
  if (d.size() == 1 || !d.overlap_grad_sync || d.grid.pp > 1) return nullptr;
  if (!d.reducer) {
    // The same groups and scale as sync_gradients' blocking sums.
    std::vector<comm::ReducedParameter> params;
    for (const NamedParameter& p : model.parameters())
      params.push_back({{p.name, p.tensor}, replica_group(d, p)});
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
  if (d.zero) {
    // The groups in the order zero 0 adds them: the replicated parameters first,
    // then the expert shards' sum, itself summed over the ep group; under pp the
    // stages' totals summed (tied embeddings under pp are refused at zero 1).
    const ParameterList& params = model.parameters();
    comm::WatchdogLabel label("gradient norm (chained over the replicas)");
    double total = 0;
    for (const comm::ZeroGroup& g : d.zero_groups)
      if (!g.expert_shards) total = chained_squared_sum(g, params, total);
    for (const comm::ZeroGroup& g : d.zero_groups) {
      if (!g.expert_shards) continue;
      Tensor s = full({1}, chained_squared_sum(g, params), DType::f64);
      d.grid.ep_group->all_reduce_sum(s);
      total += s.data<double>()[0];
    }
    if (d.grid.pp > 1) {
      Tensor s = full({1}, total, DType::f64);
      d.grid.pipe_group->all_reduce_sum(s);
      total = s.data<double>()[0];
    }
    const double norm = std::sqrt(total);
    if (max_norm > 0 && norm > max_norm)
      for (const comm::ZeroGroup& g : d.zero_groups)
        scale_grad_parts(owned_grads(g, params), max_norm / (norm + 1e-6));
    return norm;
  }
  // The replicated parameters' squares folded in list order (a tied table's
  // last-stage copy counted once, on stage 0), then each expert shard's fold
  // summed over the ep group.
  const ParameterList& params = model.parameters();
  double total = 0;
  for (const ReplicaGroup& g : replica_groups(d, params)) {
    if (!g.expert_shards) {
      std::vector<size_t> counted;
      for (size_t i : g.params)
        if (!tied_copy(d, params[i])) counted.push_back(i);
      total = grad_squared_sum_from(total, grads(params, counted));
      continue;
    }
    Tensor s = full({1}, grad_squared_sum_from(0.0, grads(params, g.params)), DType::f64);
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

void gather_parameters(Distributed& d, const LanguageModel& model) {
  if (!d.zero) return;
  comm::WatchdogLabel label("parameter gather (train.zero 1)");
  const ParameterList& params = model.parameters();
  for (const comm::ZeroGroup& g : d.zero_groups) {
    std::vector<Tensor> tensors;
    for (size_t i : g.params) tensors.push_back(params[i].tensor.detach());
    comm::all_gather_params(*g.comm, tensors, g.shards, d.grad_bucket_bytes);
  }
}

Tensor full_master(Distributed& d, const LanguageModel& model, const Optimizer& opt, size_t i) {
  const NamedParameter& p = model.parameters()[i];
  // The same decision on every rank of the group: a bf16 parameter has its master
  // on the ranks that own some of it (a Muon matrix: on one), none elsewhere.
  if (!d.zero || !opt.sharded() || p.tensor.dtype() != DType::bf16) return opt.master_or_parameter(i);
  const Tensor master = opt.master(i);
  const Tensor own = master.defined() ? master.detach() : empty({0}, DType::f32, p.tensor.device());
  return alias(comm::all_gather_owned(*replica_group(d, p), own), p.tensor.shape());
}

ParameterList full_state(Distributed& d, const LanguageModel& model, const Optimizer* opt) {
  ParameterList out;
  NoGradGuard no_grad;
  comm::WatchdogLabel label("expert gather");
  const ParameterList& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const NamedParameter& p = params[i];
    NamedParameter q = p;
    if (opt) q.tensor = full_master(d, model, *opt, i);
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
