// MoE layer (docs/model.md#moe). Differentiable parts are compositions of
// gradient-checked ops (linear, sigmoid/softmax, index_select, grouped_linear,
// situ_glu, rms_norm); selection and the expert plan are integer bookkeeping.
#include "nn/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <spdlog/spdlog.h>

#include "core/grad_mode.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "comm/collectives.h"
#include "comm/communicator.h"
#include "comm/watchdog.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/moe/moe.h"
#include "ops/norm/norm.h"
#include "ops/router/router_kernels.h"
#include "ops/router/router_simt.h"
#include "ops/reduce/reduce.h"
#include "ops/situ/situ.h"
#include "ops/softmax/softmax.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

Tensor index_tensor(const std::vector<int64_t>& v) {
  Tensor t = empty({static_cast<int64_t>(v.size())}, DType::i64);
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}

}  // namespace

std::vector<int64_t> select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                                    int64_t topk_group) {
  MT_CHECK(scores.dim() == 2, "select_experts: scores must be [N, E], got {}", scores.shape());
  const int64_t N = scores.size(0), E = scores.size(1);
  MT_CHECK(bias.shape() == Shape{E}, "select_experts: bias {} must be [{}]", bias.shape(), E);
  MT_CHECK(k >= 1 && k <= E, "select_experts: top_k = {} must be in [1, {}]", k, E);
  MT_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
               k <= topk_group * (E / n_group),
           "select_experts: {} experts in {} groups, {} groups kept, top_k {}: groups must divide the experts and the "
           "kept groups hold at least top_k experts",
           E, n_group, topk_group, k);
  if (scores.is_cuda()) {  // selected on the GPU (ops/router/router_simt.h, the same picks); N·k ids come back
    Tensor experts = empty({N, k}, DType::i64, scores.device());
    cuda::select_experts(experts, scores, bias, k, n_group, topk_group);
    const Tensor host = experts.to(kCpu);
    return std::vector<int64_t>(host.data<int64_t>(), host.data<int64_t>() + N * k);
  }
  // f32/f64 scores are read in place (widened per element), others (bf16) widened first.
  const bool native = scores.dtype() == DType::f32 || scores.dtype() == DType::f64;
  const Tensor sc = native ? scores.contiguous() : scores.to(DType::f64), b64 = bias.to(DType::f64).contiguous();
  const double* b = b64.data<double>();
  const int64_t G = E / n_group;
  std::vector<int64_t> out(static_cast<size_t>(N * k));
  // Rows are independent: chunks of rows in parallel, each with its own buffers.
  dispatch_float(sc.dtype(), "select_experts", [&](auto tag) {
    using S = decltype(tag);
    const S* s = sc.data<S>();
    cpu::parallel_for(N, 64, [&](int64_t lo, int64_t hi) {
      std::vector<double> c(static_cast<size_t>(E));
      std::vector<int64_t> idx(static_cast<size_t>(E)), groups(static_cast<size_t>(n_group)), kept;
      std::vector<double> group_score(static_cast<size_t>(n_group));
      // a before b: larger value, then lower index; NaN ranks first (never silently skipped).
      auto before = [&](int64_t i, int64_t j) { return simt::ranks_first(c[i], i, c[j], j); };
      for (int64_t n = lo; n < hi; ++n) {
        for (int64_t e = 0; e < E; ++e) c[e] = static_cast<double>(s[n * E + e]) + b[e];
        std::iota(idx.begin(), idx.end(), 0);
        if (n_group > 1) {
          for (int64_t g = 0; g < n_group; ++g) {  // sum of the two first biased scores of the group
            auto first = idx.begin() + g * G, last = first + G;
            const int64_t top = std::min<int64_t>(2, G);
            std::partial_sort(first, first + top, last, before);
            group_score[g] = 0;
            for (int64_t i = 0; i < top; ++i) group_score[g] += c[first[i]];
          }
          std::iota(groups.begin(), groups.end(), 0);
          std::partial_sort(groups.begin(), groups.begin() + topk_group, groups.end(), [&](int64_t x, int64_t y) {
            return simt::ranks_first(group_score[x], x, group_score[y], y);
          });
          kept.clear();
          for (int64_t i = 0; i < topk_group; ++i)
            for (int64_t e = groups[i] * G; e < (groups[i] + 1) * G; ++e) kept.push_back(e);
          std::partial_sort(kept.begin(), kept.begin() + k, kept.end(), before);
          std::copy(kept.begin(), kept.begin() + k, out.begin() + n * k);
        } else {
          std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), before);
          std::copy(idx.begin(), idx.begin() + k, out.begin() + n * k);
        }
      }
    });
  });
  return out;
}

Routing route(const Tensor& x, const Tensor& gate_weight, const Tensor& bias, const MoeConfig& c) {
  MT_CHECK(x.dim() == 2 && gate_weight.dim() == 2 && x.size(1) == gate_weight.size(1),
           "moe router: x {} must be [N, D] and gate.weight {} [E, D]", x.shape(), gate_weight.shape());
  const int64_t N = x.size(0), E = gate_weight.size(0), k = c.top_k;
  Routing r;
  // Mixed precision: gate.weight stays f32 and x is widened to it, so logits,
  // scores and top-k are f32 (docs/model.md#moe-router); otherwise x already has the weight's dtype.
  r.logits = linear(x.to(gate_weight.dtype()), gate_weight);  // [N, E]
  r.scores = c.score == RouterScore::sigmoid ? sigmoid(r.logits) : softmax(r.logits);
  {
    NoGradGuard no_grad;
    r.experts = select_experts(r.scores.detach(), bias, k, c.n_group, c.topk_group);
  }
  std::vector<int64_t> flat(r.experts.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) flat[n * k + j] = n * E + r.experts[n * k + j];
  Tensor w = reshape(index_select(reshape(r.scores, {N * E}), 0, index_tensor(flat)), {N, k});  // selected s
  if (c.renormalize && k > 1) w = div(w, add_scalar(sum(w, -1, true), 1e-20));
  if (c.routed_scaling_factor != 1.0) w = mul_scalar(w, c.routed_scaling_factor);
  r.weights = w;
  return r;
}

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

MoeLayer::MoeLayer(const MoeConfig& c, int64_t D, const FfnConfig& ffn, double init_std, ParamFactory& f,
                   const std::string& p, ExpertShard shard)
    : c_(c), shard_(shard), ffn_(ffn), d_model_(D) {
  MT_CHECK(c.num_experts >= 1 && c.top_k >= 1 && c.top_k <= c.num_experts && c.expert_d_ff >= 1,
           "moe layer {}: {} experts, top_k {}, expert_d_ff {}", p, c.num_experts, c.top_k, c.expert_d_ff);
  MT_CHECK(ffn.kind != FfnKind::gelu, "moe layer {}: experts are gated MLPs (situ_glu or swiglu), not gelu", p);
  const int64_t E = c.num_experts, F = c.expert_d_ff, W = c.latent_dim > 0 ? c.latent_dim : D;
  MT_CHECK(shard.size >= 1 && shard.index >= 0 && shard.index < shard.size && E % shard.size == 0,
           "moe layer {}: {} experts cannot be split over {} expert-parallel ranks (not a multiple)", p, E, shard.size);
  const int64_t El = E / shard.size, lo = shard.index * El, hi = lo + El;
  const Init w = Init::trunc_normal(init_std);
  gate_weight = f.make(p + "gate.weight", {E, D}, w, "router", true);
  bias = f.buffer(p + "gate.e_score_correction_bias", {E}, DType::f32);
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
}

Tensor MoeLayer::experts_forward(const Tensor& z, const std::vector<int64_t>& counts) const {
  Tensor g = grouped_linear(z, w1, counts), u = grouped_linear(z, w3, counts);
  Tensor h;
  if (ffn_.kind == FfnKind::situ_glu) {
    std::optional<double> lambda;
    if (ffn_.situ_linear_beta > 0) lambda = ffn_.situ_linear_beta;
    h = situ_glu(g, u, ffn_.situ_beta, lambda);
  } else {
    h = mul(silu(g), u);
  }
  return grouped_linear(h, w2, counts);
}

void MoeLayer::set_expert_group(comm::Communicator* group) {
  MT_CHECK(!group || (group->size() == shard_.size && group->rank() == shard_.index),
           "moe layer: expert group of size {} (rank {}) for experts sharded {} ways (shard {})",
           group ? group->size() : 0, group ? group->rank() : 0, shard_.size, shard_.index);
  ep_ = group;
}

Tensor MoeLayer::dispatch(const Tensor& z, const std::vector<int64_t>& counts, const ExpertsFn& experts) const {
  MT_CHECK(static_cast<int64_t>(counts.size()) == c_.num_experts, "moe dispatch: {} counts for {} experts",
           counts.size(), c_.num_experts);
  if (shard_.size == 1 && !ep_) return experts(z, counts);
  MT_CHECK(ep_, "moe layer: experts are sharded over {} ranks but no expert-parallel group is set", shard_.size);
  comm::WatchdogLabel label("expert dispatch");  // and combine; their backward is labelled "backward"
  const int P = shard_.size;
  const int64_t El = c_.num_experts / P;
  // Rows for rank r are contiguous (experts sorted globally, rank r holds a range).
  std::vector<int64_t> send_rows(static_cast<size_t>(P), 0), per_peer(static_cast<size_t>(P), El);
  for (int r = 0; r < P; ++r)
    for (int64_t e = r * El; e < (r + 1) * El; ++e) send_rows[r] += counts[e];
  // recv_counts[s·El + e]: rows source s sends for local expert e.
  Tensor sent_counts = empty({P * El}, DType::i64);
  std::copy(counts.begin(), counts.end(), sent_counts.data<int64_t>());
  Tensor received = ep_->all_to_all_v(sent_counts, per_peer, per_peer);
  const std::vector<int64_t> recv_counts(received.data<int64_t>(), received.data<int64_t>() + P * El);
  std::vector<int64_t> recv_rows(static_cast<size_t>(P), 0), local(static_cast<size_t>(El), 0);
  std::vector<int64_t> offset(static_cast<size_t>(P * El));
  int64_t row = 0;
  for (int s = 0; s < P; ++s)
    for (int64_t e = 0; e < El; ++e) {
      offset[s * El + e] = row;
      row += recv_counts[s * El + e];
      recv_rows[s] += recv_counts[s * El + e];
      local[e] += recv_counts[s * El + e];
    }
  if (!logged_sizes_) {
    logged_sizes_ = true;
    spdlog::debug("moe dispatch (ep rank {} of {}): sends {} rows [{}], receives {} [{}], {} per local expert [{}]",
                  shard_.index, P, z.size(0), fmt::join(send_rows, ", "), row, fmt::join(recv_rows, ", "), El,
                  fmt::join(local, ", "));
  }
  Tensor recv = comm::all_to_all_v(*ep_, z, send_rows, recv_rows);  // [row, W], (source, expert) order
  // Group by local expert (source order within an expert), run, and restore the order.
  std::vector<int64_t> perm, inverse(static_cast<size_t>(row));
  perm.reserve(static_cast<size_t>(row));
  for (int64_t e = 0; e < El; ++e)
    for (int s = 0; s < P; ++s)
      for (int64_t i = 0; i < recv_counts[s * El + e]; ++i) {
        inverse[offset[s * El + e] + i] = static_cast<int64_t>(perm.size());
        perm.push_back(offset[s * El + e] + i);
      }
  Tensor out = experts(index_select(recv, 0, index_tensor(perm)), local);
  return comm::all_to_all_v(*ep_, index_select(out, 0, index_tensor(inverse)), recv_rows, send_rows);
}

Tensor MoeLayer::forward(const Tensor& x, bool training, Routing* routing) {
  MT_CHECK(x.dim() == 3 && x.size(2) == d_model_, "moe layer: x {} must be [B, T, {}]", x.shape(), d_model_);
  const int64_t B = x.size(0), T = x.size(1), N = B * T, D = d_model_, E = c_.num_experts, k = c_.top_k;
  const int64_t W = c_.latent_dim > 0 ? c_.latent_dim : D;
  Tensor xf = reshape(x, {N, D});
  Routing r = route(xf, gate_weight, bias, c_);
  const int64_t capacity =
      c_.capacity_factor > 0
          ? static_cast<int64_t>(std::ceil(c_.capacity_factor * static_cast<double>(N * k) / static_cast<double>(E)))
          : 0;
  ExpertPlan plan = plan_experts(r.experts, E, capacity);
  if (training) {  // the bias update and the metrics count training assignments only
    for (int64_t e = 0; e < E; ++e) stats_.tokens_per_expert[e] += static_cast<double>(plan.counts[e]);
    stats_.dropped += plan.dropped;
  }

  // Dispatch: z rows in expert order (row i is token order[i] / k).
  Tensor z = c_.latent_dim > 0 ? linear(xf, down_proj) : xf;  // [N, W]
  const int64_t M = static_cast<int64_t>(plan.order.size());
  std::vector<int64_t> token(plan.order.size());
  for (int64_t i = 0; i < M; ++i) token[i] = plan.order[i] / k;
  Tensor out = dispatch(index_select(z, 0, index_tensor(token)), plan.counts,
                        [this](const Tensor& rows, const std::vector<int64_t>& n) { return experts_forward(rows, n); });
  // Combine: back to (token, slot) order (dropped slots read a zero row), weight, sum over slots.
  std::vector<int64_t> slot_row(static_cast<size_t>(N * k), M);
  for (int64_t i = 0; i < M; ++i) slot_row[plan.order[i]] = i;
  if (plan.dropped > 0) out = concat({out, zeros({1, W}, out.dtype(), out.device())}, 0);
  Tensor slots = reshape(index_select(out, 0, index_tensor(slot_row)), {N, k, W});
  // The f32 routing weights meet bf16 expert outputs in their dtype (mixed precision).
  Tensor y = sum(mul(slots, reshape(r.weights.to(slots.dtype()), {N, k, 1})), 1);  // [N, W]
  if (c_.latent_dim > 0) {
    if (latent_norm.defined()) y = rms_norm(y, latent_norm, c_.latent_norm_eps);
    y = linear(y, up_proj);
  }
  if (shared) y = add(y, shared->forward(xf));

  aux_loss_ = Tensor();
  if (training && c_.aux_loss_weight > 0) {
    // Sequence-wise balance loss (docs/model.md#moe-auxiliary-losses): α Σ_i f_i P_i per sequence, mean over the B sequences.
    std::vector<double> f(static_cast<size_t>(B * E), 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < k; ++j) f[(n / T) * E + r.experts[n * k + j]] += static_cast<double>(E) / (k * T);
    Tensor ft = empty({B, E}, DType::f64);
    std::copy(f.begin(), f.end(), ft.data<double>());
    Tensor P = mean(reshape(div(r.scores, sum(r.scores, -1, true)), {B, T, E}), 1);  // [B, E]
    aux_loss_ = mul_scalar(sum(mul(P, ft.to(P.dtype()).to(P.device()))), c_.aux_loss_weight / static_cast<double>(B));
  }
  if (training && c_.z_loss_weight > 0) {
    // z-loss: mean over tokens of logsumexp(logits)^2 (lse = x_0 − log_softmax(x)_0).
    Tensor lse = sub(slice(r.logits, -1, 0, 1), slice(log_softmax(r.logits), -1, 0, 1));
    Tensor z_loss = mul_scalar(mean(square(lse)), c_.z_loss_weight);
    aux_loss_ = aux_loss_.defined() ? add(aux_loss_, z_loss) : z_loss;
  }
  if (routing) *routing = std::move(r);
  return reshape(y, {B, T, D});
}

void MoeLayer::update_bias(const std::vector<double>& counts) {
  const int64_t E = c_.num_experts;
  MT_CHECK(static_cast<int64_t>(counts.size()) == E, "moe bias update: {} counts for {} experts", counts.size(), E);
  if (c_.bias_update_rate <= 0) return;
  const double mean_count = std::accumulate(counts.begin(), counts.end(), 0.0) / static_cast<double>(E);
  std::vector<double> delta(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const double d = mean_count - counts[e];
    delta[e] = c_.bias_update_rate * static_cast<double>((d > 0) - (d < 0));
  }
  const double mean_delta = std::accumulate(delta.begin(), delta.end(), 0.0) / static_cast<double>(E);
  float* b = bias.data<float>();
  for (int64_t e = 0; e < E; ++e) b[e] = static_cast<float>(static_cast<double>(b[e]) + delta[e] - mean_delta);
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

RouterScore parse_router_score(const std::string& name) {
  if (name == "sigmoid") return RouterScore::sigmoid;
  if (name == "softmax") return RouterScore::softmax;
  MT_THROW("unknown router score '{}' (sigmoid, softmax)", name);
}

}  // namespace moetrain
