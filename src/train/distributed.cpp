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
  ParameterList replicated, shards;
  split(d, model.parameters(), replicated, shards);
  comm::WatchdogLabel label("gradient sync");
  comm::GradSyncOptions o;
  o.scale = 1.0 / d.size();
  o.bucket_bytes = d.grad_bucket_bytes;
  comm::all_reduce_grads(*d.world, grad_tensors(replicated), o);
  if (!shards.empty()) comm::all_reduce_grads(*d.grid.dp_group, grad_tensors(shards), o);
}

std::unique_ptr<autograd::GradReadyHookGuard> begin_overlapped_grad_sync(Distributed& d, const LanguageModel& model) {
  if (d.size() == 1 || !d.overlap_grad_sync) return nullptr;
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
  double total = grad_squared_sum(replicated);
  if (!shards.empty()) {
    Tensor s = full({1}, grad_squared_sum(shards), DType::f64);
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
  return out;
}

}  // namespace moetrain
