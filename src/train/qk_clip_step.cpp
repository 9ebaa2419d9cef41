#include "train/qk_clip_step.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "comm/communicator.h"
#include "comm/watchdog.h"
#include "core/grad_mode.h"
#include "ops/elementwise/elementwise.h"
#include "ops/view/view.h"
#include "optim/qk_clip.h"
#include "train/distributed.h"

namespace moetrain {

namespace {

// Element-wise maximum of t (f64, CPU) over the ranks of `group`: an all-gather of
// the rows, then the maximum of each column (a few hundred values per step).
void qk_all_reduce_max(comm::Communicator& group, Tensor& t) {
  if (group.size() == 1) return;
  const int64_t n = t.numel();
  const Tensor all = group.all_gather(reshape(t, {1, n}));  // [size, n]
  const double* a = all.data<double>();
  double* out = t.data<double>();
  for (int r = 0; r < group.size(); ++r)
    for (int64_t j = 0; j < n; ++j) out[j] = std::max(out[j], a[r * n + j]);
}

// The factor of each row of a [rows, cols] weight (or of each entry of a bias
// [rows]) that QK-Clip multiplies it by: the layout functions of optim/qk_clip.h
// applied to a column of ones.
Tensor qk_probe(int64_t rows) { return full({rows, 1}, 1.0, DType::f64); }
Tensor qk_probe_bias(int64_t rows) { return full({rows}, 1.0, DType::f64); }

struct RowScale {
  std::string param;
  Tensor rows;  // f64 [rows] on the CPU
};

std::vector<RowScale> row_scales(const QkClipSite& s, const std::vector<double>& gamma,
                                 const std::map<std::string, const NamedParameter*>& by_name) {
  auto rows_of = [&](const std::string& name) {
    const auto it = by_name.find(name);
    MT_CHECK(it != by_name.end(), "qk_clip: the attention layer {} names the parameter {}, which the model does not "
             "have", s.layer, name);
    return it->second->tensor.size(0);
  };
  std::vector<RowScale> out;
  auto column = [](const Tensor& t) { return reshape(t, {t.numel()}); };
  switch (s.layout) {
    case QkClipSite::Layout::mla: {
      Tensor q = qk_probe(rows_of(s.q_weight)), k = qk_probe(rows_of(s.k_weight));
      qk_clip_mla_(q, k, gamma, s.mla);
      out.push_back({s.q_weight, column(q)});
      out.push_back({s.k_weight, column(k)});
      break;
    }
    case QkClipSite::Layout::separate_qk: {
      Tensor q = qk_probe(rows_of(s.q_weight)), k = qk_probe(rows_of(s.k_weight));
      Tensor qb = s.q_bias.empty() ? Tensor() : qk_probe_bias(rows_of(s.q_bias));
      Tensor kb = s.k_bias.empty() ? Tensor() : qk_probe_bias(rows_of(s.k_bias));
      qk_clip_mha_(q, k, gamma, s.n_head, qb, kb);
      out.push_back({s.q_weight, column(q)});
      out.push_back({s.k_weight, column(k)});
      if (qb.defined()) out.push_back({s.q_bias, qb});
      if (kb.defined()) out.push_back({s.k_bias, kb});
      break;
    }
    case QkClipSite::Layout::fused_qkv: {
      Tensor w = qk_probe(rows_of(s.q_weight));
      Tensor b = s.q_bias.empty() ? Tensor() : qk_probe_bias(rows_of(s.q_bias));
      qk_clip_fused_qkv_(w, b, gamma, s.n_head);
      out.push_back({s.q_weight, column(w)});
      if (b.defined()) out.push_back({s.q_bias, b});
      break;
    }
  }
  return out;
}

// Scales the elements of parameter i this rank owns by their row's factor: the
// master when there is one (then the bf16 copy rounded from it), else the
// parameter itself.
void scale_owned_rows(Optimizer& opt, size_t i, const Tensor& rows) {
  const NamedParameter& p = opt.parameters()[i];
  const ElementRange r = opt.owned(i);
  if (r.size() == 0) return;
  const int64_t cols = p.tensor.numel() / p.tensor.size(0);
  // The factor of each owned element (row-major: element e is in row e / cols).
  Tensor factor = empty({r.size()}, DType::f64);
  const double* f = rows.data<double>();
  double* out = factor.data<double>();
  for (int64_t e = r.begin; e < r.end; ++e) out[e - r.begin] = f[e / cols];
  const Tensor master = opt.master(i);
  const Tensor target = master.defined() ? master : opt.owned_part(i, p.tensor.detach());
  const Tensor flat = reshape(target, {target.numel()});
  copy_(flat, mul(flat, factor.to(flat.dtype()).to(flat.device())));
  if (master.defined()) {
    const Tensor own = opt.owned_part(i, p.tensor.detach());
    copy_(reshape(own, {own.numel()}), flat.to(DType::bf16));
  }
}

}  // namespace

QkClipSummary apply_qk_clip(Distributed& d, LanguageModel& model, Optimizer& opt, double tau) {
  NoGradGuard no_grad;
  QkClipSummary summary;
  const std::vector<QkClipSite*> sites = model.qk_clip_sites();
  if (sites.empty()) return summary;
  // Every site's heads in one f64 vector: -inf where no logit was seen.
  int64_t total = 0;
  for (const QkClipSite* s : sites) total += s->n_head;
  Tensor all = full({total}, -std::numeric_limits<double>::infinity(), DType::f64);
  int64_t at = 0;
  for (const QkClipSite* s : sites) {
    if (s->max_logit.defined()) {
      const Tensor m = s->max_logit.detach().to(kCpu).to(DType::f64);
      MT_ASSERT(m.numel() == s->n_head, "qk_clip: {} records {} heads' logits for n_head = {}", s->layer, m.numel(),
                s->n_head);
      std::copy(m.data<double>(), m.data<double>() + s->n_head, all.data<double>() + at);
    }
    at += s->n_head;
  }
  if (d.size() > 1) {
    comm::WatchdogLabel label("QK-Clip max logits");
    qk_all_reduce_max(replica_group(d), all);
  }
  std::map<std::string, const NamedParameter*> by_name;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < opt.parameters().size(); ++i) {
    by_name[opt.parameters()[i].name] = &opt.parameters()[i];
    index[opt.parameters()[i].name] = i;
  }
  summary.max_logit = -std::numeric_limits<double>::infinity();
  at = 0;
  for (QkClipSite* s : sites) {
    const Tensor heads = alias(all, Shape{s->n_head}, at);
    at += s->n_head;
    double layer_max = -std::numeric_limits<double>::infinity();
    for (int64_t h = 0; h < s->n_head; ++h) layer_max = std::max(layer_max, heads.data<double>()[h]);
    s->max_logit = Tensor();  // the next step records afresh
    if (layer_max == -std::numeric_limits<double>::infinity()) continue;
    summary.recorded = true;
    summary.max_logit = std::max(summary.max_logit, layer_max);
    summary.layers.emplace_back(s->layer, layer_max);
    const std::vector<double> gamma = qk_clip_factors(heads.clone(), tau);
    const int64_t clipped = std::count_if(gamma.begin(), gamma.end(), [](double g) { return g < 1; });
    if (clipped == 0) continue;
    summary.clipped_heads += clipped;
    for (const RowScale& rs : row_scales(*s, gamma, by_name)) scale_owned_rows(opt, index.at(rs.param), rs.rows);
  }
  return summary;
}

}  // namespace moetrain
