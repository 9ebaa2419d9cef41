#include "train/distributed.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <spdlog/spdlog.h>

#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "core/grad_mode.h"
#include "optim/adamw.h"

namespace moetrain {

namespace {

// Expert shards differ between the ranks of an ep group; everything else is replicated.
bool sharded(const Distributed& d, const NamedParameter& p) { return d.grid.ep > 1 && p.group == "experts"; }

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
  return sharded(d, p) ? d.grid.dp_group.get() : d.world;
}

std::vector<ElementRange> make_zero_shards(Distributed& d, const ParameterList& params) {
  d.zero_groups.clear();
  for (const ReplicaGroup& g : replica_groups(d, params))
    d.zero_groups.push_back(comm::ZeroGroup{g.comm, g.expert_shards, g.params, {}});
  std::vector<ElementRange> owned(params.size());
  for (comm::ZeroGroup& g : d.zero_groups) {
    std::vector<int64_t> numels;
    for (size_t i : g.params) numels.push_back(params[i].tensor.numel());
    g.shards = comm::make_flat_shards(numels, g.comm->size());
    for (size_t k = 0; k < g.params.size(); ++k) {
      const auto [a, b] = g.shards.owned(k, g.comm->rank());
      owned[g.params[k]] = {a, b};
    }
  }
  return owned;
}

Distributed make_distributed(const Config& config) {
  Distributed d;
  d.world = &comm::world();
  const int64_t ep = config.get_int("train.ep");
  if (d.world->size() % ep != 0)
    config.fail("train.ep", fmt::format("does not divide the {} ranks of this run (world = dp x ep)", d.world->size()));
  const int64_t experts = config.get_string("model.arch") == "hybrid" ? config.get_int("model.moe.num_experts") : 0;
  if (ep > 1 && experts == 0)
    config.fail("train.ep", "expert parallelism needs MoE layers (model.moe.num_experts > 0)");
  if (ep > 1 && experts % ep != 0)
    config.fail("train.ep", fmt::format("does not divide model.moe.num_experts = {}", experts));
  const double timeout_s = config.get_number("dist.timeout_s");
  if (timeout_s > 0 && d.world->size() > 1)
    d.watchdog = std::make_unique<comm::Watchdog>(comm::WatchdogOptions{
        .timeout_s = timeout_s, .rank = d.rank(), .size = d.size(), .host = d.world->host(), .on_timeout = {}});
  d.overlap_grad_sync = config.get_bool("train.overlap_grad_sync");
  const double bucket_mb = config.get_number("train.grad_bucket_mb");
  d.grad_bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20)));
  const int64_t zero = config.get_int("train.zero");
  if (zero > 1)
    config.fail("train.zero", "is not supported yet: 0 keeps the AdamW state whole on every rank, 1 shards it over "
                              "the data-parallel replicas (ZeRO stage 1); gradients and parameters are not sharded");
  // One rank: nothing to shard; the optimizer keeps whole tensors (the same numbers).
  d.zero = d.world->size() > 1 ? static_cast<int>(zero) : 0;
  if (zero == 1 && d.zero == 0)
    spdlog::info("train.zero 1 with one rank: nothing to shard; the optimizer state stays whole");
  comm::WatchdogLabel label("process grid");
  d.grid = comm::make_process_grid(*d.world, static_cast<int>(ep), "train.ep");
  return d;
}

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
  spdlog::info("{} rank(s): dp {} x ep {}", d.size(), d.grid.dp, d.grid.ep);
  const int32_t* a = all.data<int32_t>();
  for (int r = 0; r < d.size(); ++r) {
    std::string h;
    for (int i = 0; i < kHost && a[r * (kHost + 1) + i] != 0; ++i) h += static_cast<char>(a[r * (kHost + 1) + i]);
    spdlog::info("  rank {:>3} | host {} | dp {} ep {} | {} threads", r, h, r / d.grid.ep, r % d.grid.ep,
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
  o.scale = 1.0 / d.size();
  o.bucket_bytes = d.grad_bucket_bytes;
  if (d.zero) {
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
}

std::unique_ptr<autograd::GradReadyHookGuard> begin_overlapped_grad_sync(Distributed& d, const LanguageModel& model) {
  if (d.size() == 1 || !d.overlap_grad_sync) return nullptr;
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
    // then the expert shards' sum, itself summed over the ep group.
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
    const double norm = std::sqrt(total);
    if (max_norm > 0 && norm > max_norm)
      for (const comm::ZeroGroup& g : d.zero_groups)
        scale_grad_parts(owned_grads(g, params), max_norm / (norm + 1e-6));
    return norm;
  }
  // The replicated parameters' squares folded in list order, then each expert
  // shard's fold summed over the ep group.
  const ParameterList& params = model.parameters();
  double total = 0;
  for (const ReplicaGroup& g : replica_groups(d, params)) {
    if (!g.expert_shards) {
      total = grad_squared_sum_from(total, grads(params, g.params));
      continue;
    }
    Tensor s = full({1}, grad_squared_sum_from(0.0, grads(params, g.params)), DType::f64);
    comm::WatchdogLabel label("gradient norm");
    d.grid.ep_group->all_reduce_sum(s);
    total += s.data<double>()[0];
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
    d.world->all_reduce_sum(t);
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

Tensor full_master(Distributed& d, const LanguageModel& model, const AdamW& opt, size_t i) {
  const Tensor own = opt.master_or_parameter(i);
  if (!d.zero || !opt.master_weights()[i].defined()) return own;
  const NamedParameter& p = model.parameters()[i];
  return alias(comm::all_gather_owned(*replica_group(d, p), own.detach()), p.tensor.shape());
}

ParameterList full_state(Distributed& d, const LanguageModel& model, const AdamW* opt) {
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
  return out;
}

}  // namespace moetrain
