// MoE layer (docs/model.md#moe): route (nn/router.h) -> plan -> dispatch
// (nn/dispatcher.h) -> experts -> combine. Differentiable parts are compositions
// of gradient-checked ops (index_select, grouped_linear, situ_glu, rms_norm); the
// expert plan is integer bookkeeping.
#include "nn/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "autograd/engine.h"
#include "comm/communicator.h"
#include "core/graph_capture.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/moe/moe.h"
#include "ops/norm/norm.h"
#include "ops/reduce/reduce.h"
#include "ops/situ/situ.h"
#include "ops/view/view.h"

namespace moetrain {

ExpertPlan plan_experts(const std::vector<int64_t>& experts, int64_t num_experts, int64_t capacity) {
  ExpertPlan p;
  p.counts.assign(static_cast<size_t>(num_experts), 0);
  for (int64_t e : experts) {
    MT_ASSERT(e >= 0 && e < num_experts, "expert id {} outside [0, {})", e, num_experts);
    ++p.counts[e];
  }
  if (capacity > 0)
    for (int64_t& n : p.counts) {
      p.dropped += std::max<int64_t>(0, n - capacity);
      n = std::min(n, capacity);
    }
  std::vector<int64_t> next(static_cast<size_t>(num_experts), 0);  // counting sort, stable
  for (int64_t e = 1; e < num_experts; ++e) next[e] = next[e - 1] + p.counts[e - 1];
  std::vector<int64_t> end = next;
  for (int64_t e = 0; e < num_experts; ++e) end[e] += p.counts[e];
  p.order.assign(static_cast<size_t>(experts.size()) - static_cast<size_t>(p.dropped), 0);
  for (size_t a = 0; a < experts.size(); ++a) {
    const int64_t e = experts[a];
    if (next[e] < end[e]) p.order[next[e]++] = static_cast<int64_t>(a);
  }
  return p;
}

namespace {

// The layer's own checks, before any parameter is made.
const MoeConfig& checked(const MoeConfig& c, const FfnConfig& ffn, ExpertShard shard, const std::string& p) {
  MT_CHECK(c.num_experts >= 1 && c.top_k >= 1 && c.top_k <= c.num_experts && c.expert_d_ff >= 1,
           "moe layer {}: {} experts, top_k {}, expert_d_ff {}", p, c.num_experts, c.top_k, c.expert_d_ff);
  MT_CHECK(ffn.kind != FfnKind::gelu, "moe layer {}: experts are gated MLPs (situ_glu or swiglu), not gelu", p);
  MT_CHECK(shard.size >= 1 && shard.index >= 0 && shard.index < shard.size && c.num_experts % shard.size == 0,
           "moe layer {}: {} experts cannot be split over {} expert-parallel ranks (not a multiple)", p, c.num_experts,
           shard.size);
  return c;
}

// Sharded experts without their group: a clear error at the first forward.
class MissingGroupDispatcher : public Dispatcher {
 public:
  explicit MissingGroupDispatcher(int ranks) : ranks_(ranks) {}
  Tensor dispatch(const Tensor&, const std::vector<int64_t>&, const ExpertsFn&) const override {
    MT_THROW("moe layer: experts are sharded over {} ranks but no expert-parallel group is set", ranks_);
  }

 private:
  int ranks_;
};

}  // namespace

MoeLayer::MoeLayer(const MoeConfig& c, int64_t D, const FfnConfig& ffn, double init_std, ParamFactory& f,
                   const std::string& p, ExpertShard shard)
    : router(checked(c, ffn, shard, p), D, init_std, f, p), c_(c), shard_(shard), ffn_(ffn), d_model_(D) {
  const int64_t E = c.num_experts, F = c.expert_d_ff, W = c.latent_dim > 0 ? c.latent_dim : D;
  const int64_t El = E / shard.size, lo = shard.index * El, hi = lo + El;
  const Init w = Init::trunc_normal(init_std);
  if (c.latent_dim > 0) down_proj = f.make(p + "routed_expert_down_proj.weight", {W, D}, w, "experts_latent", true);
  w1 = f.make_rows(p + "experts.w1.weight", {E, F, W}, lo, hi, w, "experts", true);
  w3 = f.make_rows(p + "experts.w3.weight", {E, F, W}, lo, hi, w, "experts", true);
  w2 = f.make_rows(p + "experts.w2.weight", {E, W, F}, lo, hi, w, "experts", true);
  if (c.latent_dim > 0 && c.latent_norm) latent_norm = f.make(p + "routed_expert_norm.weight", {W}, Init::ones(), "norm", false);
  if (c.latent_dim > 0) up_proj = f.make(p + "routed_expert_up_proj.weight", {D, W}, w, "experts_latent", true);
  if (c.num_shared_experts > 0) {
    FfnConfig sc = ffn;
    sc.d_model = D;
    sc.d_ff = F * c.num_shared_experts;
    sc.situ_learnable_beta = false;
    sc.init_std = init_std;
    shared = std::make_unique<DenseFfn>(sc, f, p + "shared_experts.", "shared_experts");
  }
  stats_.tokens_per_expert.assign(static_cast<size_t>(E), 0.0);
  set_expert_group(nullptr);
}

Tensor MoeLayer::experts_forward(const Tensor& z, const std::vector<int64_t>& counts) const {
  return expert_mlp(z, [counts](const Tensor& x, const Tensor& w) { return grouped_linear(x, w, counts); });
}

Tensor MoeLayer::experts_forward(const Tensor& z, const Tensor& offsets) const {
  return expert_mlp(z, [offsets](const Tensor& x, const Tensor& w) { return grouped_linear(x, w, offsets); });
}

Tensor MoeLayer::expert_mlp(const Tensor& z, const GroupedGemm& gemm) const {
  // Activation recomputation (docs/training.md#activation-recomputation): `experts`
  // runs all of this again in backward (only the rows in and out are kept); `act`
  // the activation and the down-projection (gate and up outputs kept).
  auto act_down = [this, gemm](const Tensors& gu) {
    Tensor h;
    if (ffn_.kind == FfnKind::situ_glu) {
      std::optional<double> lambda;
      if (ffn_.situ_linear_beta > 0) lambda = ffn_.situ_linear_beta;
      h = situ_glu(gu[0], gu[1], ffn_.situ_beta, lambda);
    } else {
      h = mul(silu(gu[0]), gu[1]);
    }
    return Tensors{gemm(h, w2)};
  };
  auto mlp = [this, gemm, act_down](const Tensors& rows) {
    const Tensors gu{gemm(rows[0], w1), gemm(rows[0], w3)};
    return !c_.recompute_experts && ffn_.recompute_act ? checkpoint(act_down, gu) : act_down(gu);
  };
  return (c_.recompute_experts ? checkpoint(mlp, {z}) : mlp({z}))[0];
}

void MoeLayer::set_expert_group(comm::Communicator* group) {
  MT_CHECK(!group || (group->size() == shard_.size && group->rank() == shard_.index),
           "moe layer: expert group of size {} (rank {}) for experts sharded {} ways (shard {})",
           group ? group->size() : 0, group ? group->rank() : 0, shard_.size, shard_.index);
  if (group) dispatcher_ = std::make_unique<AllToAllDispatcher>(*group, c_.num_experts);
  else if (shard_.size == 1) dispatcher_ = std::make_unique<LocalDispatcher>();
  else dispatcher_ = std::make_unique<MissingGroupDispatcher>(shard_.size);
}

Tensor MoeLayer::dispatch(const Tensor& z, const std::vector<int64_t>& counts, const ExpertsFn& experts) const {
  MT_CHECK(static_cast<int64_t>(counts.size()) == c_.num_experts, "moe dispatch: {} counts for {} experts",
           counts.size(), c_.num_experts);
  return dispatcher_->dispatch(z, counts, experts);
}

int64_t MoeLayer::capacity(int64_t N) const {
  const int64_t E = c_.num_experts, k = c_.top_k;
  return c_.capacity_factor > 0
             ? static_cast<int64_t>(std::ceil(c_.capacity_factor * static_cast<double>(N * k) / static_cast<double>(E)))
             : 0;
}

Tensor MoeLayer::forward(const Tensor& x, bool training, Routing* routing) {
  MT_CHECK(x.dim() == 3 && x.size(2) == d_model_, "moe layer: x {} must be [B, T, {}]", x.shape(), d_model_);
  const int64_t B = x.size(0), T = x.size(1), N = B * T, D = d_model_;
  Tensor xf = reshape(x, {N, D});
  // Local experts are planned where the ids are (ops/moe/moe.h, ExpertRows): on a
  // GPU nothing waits for the router. The host plan serves expert parallelism (its
  // exchange sizes are host numbers) and a caller asking for the ids. With it, the
  // ids travel to the host while the work that does not need them is queued: the
  // latent projection and the shared experts (docs/cuda.md, "Host synchronisation").
  const bool device_plan = shard_.size == 1 && !routing;
  PendingRouting pending = router.begin_route(xf, !device_plan);
  Tensor z = c_.latent_dim > 0 ? linear(xf, down_proj) : xf;  // [N, W]
  Tensor shared_y = shared ? shared->forward(xf) : Tensor();
  Routing r;
  Tensor y;
  if (device_plan) {
    r.selected = pending.experts.tensor();
    y = local_experts(z, r.selected, pending.weights, training);
    r.logits = std::move(pending.logits);
    r.scores = std::move(pending.scores);
    r.weights = std::move(pending.weights);
  } else {
    r = router.finish_route(std::move(pending));
    y = dispatched_experts(z, r, N, training);
  }
  if (c_.latent_dim > 0) {
    if (latent_norm.defined()) y = rms_norm(y, latent_norm, c_.latent_norm_eps);
    y = linear(y, up_proj);
  }
  if (shared) y = add(y, shared_y);
  aux_loss_ = training ? router.aux_loss(r, B, T) : Tensor();  // recomputed: the same value, now with its graph
  if (routing) *routing = std::move(r);
  return reshape(y, {B, T, D});
}

Tensor MoeLayer::local_experts(const Tensor& z, const Tensor& ids, const Tensor& weights, bool training) {
  const ExpertRows plan = plan_expert_rows(ids, c_.num_experts, capacity(z.size(0)));
  // The bias update and the metrics count training assignments only, once: not
  // again when activation recomputation runs the layer a second time in backward.
  // Summed where the plan is; read once per optimizer step (MoeLayer::stats()).
  if (training && !autograd::recomputing()) {
    const Tensor counts = plan.counts.to(DType::f64);
    stats_.pending = stats_.pending.defined() ? add(stats_.pending, counts) : counts;
    // A CUDA graph's replay writes the same sum; the host handle to it is set again.
    graph::after_replay([stats = &stats_, sum = stats_.pending] { stats->pending = sum; });
  }
  const Tensor rows = moe_gather(z, plan);
  // The three expert products read the offsets where they are, or on the host, read
  // there once (a wait on a GPU: f32 experts).
  const Tensor offsets = grouped_linear_offsets_on_device(rows, w1) ? plan.offsets : plan.offsets.to(kCpu);
  const Tensor out = experts_forward(rows, offsets);
  // The f32 routing weights meet bf16 expert outputs in their dtype (mixed precision).
  return moe_combine(out, plan, weights.to(out.dtype()));  // [N, W]
}

Tensor MoeLayer::dispatched_experts(const Tensor& z, const Routing& r, int64_t N, bool training) {
  const int64_t E = c_.num_experts, k = c_.top_k;
  const ExpertPlan plan = plan_experts(r.experts, E, capacity(N));
  if (training && !autograd::recomputing()) {
    for (int64_t e = 0; e < E; ++e) stats_.tokens_per_expert[e] += static_cast<double>(plan.counts[e]);
    stats_.dropped += plan.dropped;
  }
  // Dispatch: z rows in expert order (row i is token order[i] / k).
  std::vector<int64_t> token(plan.order.size());
  for (size_t i = 0; i < plan.order.size(); ++i) token[i] = plan.order[i] / k;
  Tensor out = dispatch(index_select(z, 0, token), plan.counts,
                        [this](const Tensor& rows, const std::vector<int64_t>& n) { return experts_forward(rows, n); });
  return combine(out, plan, r.weights, N);
}

void MoeStats::settle() {
  if (!pending.defined()) return;
  const Tensor host = pending.to(kCpu);
  const double* p = host.data<double>();
  const size_t E = tokens_per_expert.size();
  MT_ASSERT(host.numel() == static_cast<int64_t>(E) + 1, "moe stats: {} pending counts for {} experts", host.numel(), E);
  for (size_t e = 0; e < E; ++e) tokens_per_expert[e] += p[e];
  dropped += static_cast<int64_t>(p[E]);
  pending = Tensor();
}

Tensor MoeLayer::combine(const Tensor& out, const ExpertPlan& plan, const Tensor& weights, int64_t N) const {
  const int64_t k = c_.top_k, M = static_cast<int64_t>(plan.order.size());
  // Each (token, slot) reads its output row (dropped slots: row M, which adds nothing),
  // weighted and summed over slots in one op (ops/moe/moe.h).
  std::vector<int64_t> slot_row(static_cast<size_t>(N * k), M);
  for (int64_t i = 0; i < M; ++i) slot_row[plan.order[i]] = i;
  // The f32 routing weights meet bf16 expert outputs in their dtype (mixed precision).
  return moe_combine(out, slot_row, weights.to(out.dtype()));  // [N, W]
}

MoeLoad moe_load(const std::vector<double>& counts) {
  MoeLoad l;
  if (counts.empty()) return l;
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  const double mean_count = total / static_cast<double>(counts.size());
  l.max_over_mean = mean_count > 0 ? *std::max_element(counts.begin(), counts.end()) / mean_count : 0.0;
  for (double c : counts) l.dead += c == 0;
  return l;
}

}  // namespace moetrain
