// Muon (docs/model.md#muon) from the tensor ops: no kernels of its own. The
// products go through matmul (BLAS on the CPU, cuBLAS strided-batched GEMMs on
// CUDA), the Frobenius norms through sum (accumulated in double), the rest through
// the elementwise ops; every temporary lives for one parameter's update.
#include "optim/muon.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/grad_mode.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/reduce/reduce.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

bool is_float(DType t) { return t == DType::f32 || t == DType::f64; }

// A matrix [A, B] or a batch [E, A, B] (what Muon updates).
bool is_matrix_or_batch(const Tensor& t) { return t.dim() == 2 || t.dim() == 3; }

// The largest |element| of t (NaN when t holds one), read on the host.
double muon_max_abs(const Tensor& t) {
  const Tensor flat = reshape(t, {t.numel()});
  const double hi = max(flat, 0).to(DType::f64).to(kCpu).item<double>();
  const double lo = max(neg(flat), 0).to(DType::f64).to(kCpu).item<double>();
  return std::isnan(hi) || std::isnan(lo) ? std::nan("") : std::max(hi, lo);
}

}  // namespace

void validate(const MuonOptions& o) {
  MT_CHECK(std::isfinite(o.momentum) && o.momentum >= 0 && o.momentum < 1,
           "muon: momentum = {} is outside [0, 1); 0.95 is the usual value", o.momentum);
  MT_CHECK(o.ns_steps >= 1, "muon: ns_steps = {} must be >= 1 (5 is the usual value)", o.ns_steps);
  MT_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
           "muon: weight_decay = {} must be finite and >= 0", o.weight_decay);
  MT_CHECK(std::isfinite(o.eps) && o.eps > 0, "muon: eps = {} must be finite and > 0 (1e-7 is the usual value)",
           o.eps);
}

double muon_update_scale(int64_t rows, int64_t cols) {
  return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
}

Tensor newton_schulz(const Tensor& x, int64_t steps, double eps) {
  MT_CHECK(is_matrix_or_batch(x) && is_float(x.dtype()),
           "newton_schulz: x is {}; expected an f32 or f64 matrix [A, B] or batch [E, A, B]", describe(x));
  MT_CHECK(steps >= 1, "newton_schulz: steps = {} must be >= 1", steps);
  MT_CHECK(std::isfinite(eps) && eps > 0, "newton_schulz: eps = {} must be finite and > 0", eps);
  NoGradGuard no_grad;
  const Tensor in = x.detach();
  if (in.numel() == 0) return zeros_like(in);
  const int64_t A = in.size(-2), B = in.size(-1), E = in.dim() == 3 ? in.size(0) : 1;
  // Per matrix: X = x / (‖x‖_F + eps).
  const Tensor norm = sqrt(sum(reshape(square(in), {E, A * B}), 1));  // [E]
  const Tensor denom = add_scalar(norm, eps);
  Tensor X = div(in, in.dim() == 3 ? reshape(denom, {E, 1, 1}) : reshape(denom, {1, 1}));
  // Wide (A <= B): P = X Xᵀ [A, A], X = a X + Q X with Q = b P + c P².
  // Tall (A > B): the same on Y = Xᵀ: P = Y Yᵀ = Xᵀ X [B, B] and
  // Y = a Y + Q Y, i.e. X = a X + (Q Y)ᵀ = a X + X Qᵀ; the transposes are
  // matmul's flags, so no copy of X is made.
  const bool tall = A > B;
  for (int64_t i = 0; i < steps; ++i) {
    const Tensor P = tall ? matmul(X, X, true, false) : matmul(X, X, false, true);
    const Tensor Q = add(mul_scalar(P, kMuonNsB), mul_scalar(matmul(P, P), kMuonNsC));
    X = add(mul_scalar(X, kMuonNsA), tall ? matmul(X, Q, false, true) : matmul(Q, X));
  }
  return X;
}

void muon_update(const Tensor& param, const Tensor& grad, const Tensor& momentum, double lr,
                 const MuonOptions& options) {
  validate(options);
  MT_CHECK(param.defined() && is_matrix_or_batch(param) && is_float(param.dtype()),
           "muon: the parameter is {}; expected an f32 or f64 matrix [A, B] or batch [E, A, B]",
           param.defined() ? describe(param) : std::string("undefined"));
  for (const auto& [what, t] : {std::pair<const char*, const Tensor&>{"gradient", grad}, {"momentum", momentum}})
    MT_CHECK(t.defined() && t.shape() == param.shape() && t.dtype() == param.dtype() && t.device() == param.device(),
             "muon: the parameter is {} but its {} is {}; expected the same shape, dtype and device", describe(param),
             what, t.defined() ? describe(t) : std::string("undefined"));
  MT_CHECK(std::isfinite(lr) && lr >= 0, "muon: lr = {} must be finite and >= 0", lr);
  NoGradGuard no_grad;
  const Tensor w = param.detach(), g = grad.detach(), m = momentum.detach();
  if (w.numel() == 0) return;
  const double mu = options.momentum;
  copy_(m, add(mul_scalar(m, mu), g));                             // M = μ M + G
  const Tensor n = options.nesterov ? add(g, mul_scalar(m, mu)) : m;  // G + μ M, or M
  const Tensor x = newton_schulz(n, options.ns_steps, options.eps);
  const double decay = 1.0 - lr * options.weight_decay;
  if (decay != 1.0) copy_(w, mul_scalar(w, decay));  // W (1 − η λ)
  add_(w, x, -lr * muon_update_scale(w.size(-2), w.size(-1)));  // − η · 0.2 √max(A, B) · X
}

Muon::Muon(const ParameterList& params, MuonOptions options, std::vector<ElementRange> shard)
    : RuleOptimizer("muon", params, std::move(shard)), options_(options) {
  validate(options_);
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParameter& p = params_[i];
    const DType dt = p.tensor.dtype();
    MT_CHECK(is_matrix_or_batch(p.tensor) && (is_float(dt) || dt == DType::bf16),
             "muon: {} is {}; Muon updates f32, f64 or bf16 matrices [A, B] and expert batches [E, A, B]; "
             "give 1-D parameters, embeddings, the LM head and norms to AdamW (docs/model.md#muon)",
             p.name, describe(p.tensor));
    const ElementRange r = owned(i);
    const int64_t matrix = p.tensor.size(-2) * p.tensor.size(-1);
    MT_CHECK(matrix == 0 || (r.begin % matrix == 0 && r.end % matrix == 0),
             "muon: {} {} is owned in part ([{}, {}) of its elements): Muon needs whole matrices of {} elements on "
             "one rank", p.name, p.tensor.shape(), r.begin, r.end, matrix);
  }
  make_masters();  // a parameter that is bf16 already gets its f32 master from its own values (exact)
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor own = master_[i].defined() ? master_[i] : state_view(i, params_[i].tensor.detach());
    m_.push_back(own.defined() ? zeros_like(own) : Tensor());
  }
}

Tensor Muon::state_view(size_t i, const Tensor& t) const {
  const ElementRange r = owned(i);
  if (r.size() == 0) return {};
  if (r.size() == t.numel()) return t;
  // train.zero 1: a run of whole matrices of an expert batch [E, A, B].
  const int64_t A = t.size(-2), B = t.size(-1);
  return alias(t, Shape{r.size() / (A * B), A, B}, r.begin);
}

const Tensor& Muon::momentum(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) return m_[i];
  MT_THROW("muon: no parameter named {} among its {} parameters", name, params_.size());
}

void Muon::step(double lr) {
  MT_CHECK(std::isfinite(lr) && lr >= 0, "muon: lr = {} must be finite and >= 0", lr);
  NoGradGuard no_grad;
  // Every gradient is checked before any parameter changes: a refused step writes nothing.
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParameter& p = params_[i];
    const Tensor g = p.tensor.grad();
    if (!g.defined() || !m_[i].defined()) continue;
    const DType want = master_[i].defined() ? DType::bf16 : p.tensor.dtype();
    MT_CHECK(g.dtype() == want && g.device() == p.tensor.device() && g.shape() == p.tensor.shape(),
             "muon: {} is {} but its gradient is {}; expected a {} gradient of the same shape and device", p.name,
             describe(p.tensor), describe(g), want);
  }
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParameter& p = params_[i];
    const Tensor g = p.tensor.grad();
    if (!g.defined() || !m_[i].defined()) continue;  // no gradient, or another rank's (train.zero 1)
    MuonOptions o = options_;
    if (!p.decay) o.weight_decay = 0;
    const Tensor w = state_view(i, p.tensor.detach()), own_g = state_view(i, g);
    if (!master_[i].defined()) {
      muon_update(w, own_g, m_[i], lr, o);
      continue;
    }
    // Mixed precision: the bf16 gradient widened to f32 (exact), the f32 master
    // updated as an f32 parameter would be, the bf16 parameter rounded from it.
    muon_update(master_[i], own_g.to(DType::f32), m_[i], lr, o);
    copy_(w, master_[i].to(DType::bf16));
  }
}

std::optional<NonFiniteTensor> Muon::non_finite_update(double lr) const {
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParameter& p = params_[i];
    Tensor g = p.tensor.grad();
    if (!g.defined() || !m_[i].defined()) continue;
    g = state_view(i, g);
    const Tensor w = master_[i].defined() ? master_[i] : state_view(i, p.tensor.detach());
    if (master_[i].defined()) g = g.to(DType::f32);
    const double mu = options_.momentum;
    // The same ops, in the same order, as muon_update.
    const Tensor m = add(mul_scalar(m_[i], mu), g);
    const Tensor n = options_.nesterov ? add(g, mul_scalar(m, mu)) : m;
    const int64_t bad_m = count_non_finite(m), bad_n = count_non_finite(n);
    if (bad_m > 0 || bad_n > 0) return NonFiniteTensor{p.name, p.tensor.shape(), std::max(bad_m, bad_n)};
    // The Frobenius norms newton_schulz divides by (an infinite one would zero X).
    const int64_t A = w.size(-2), B = w.size(-1), E = w.dim() == 3 ? w.size(0) : 1;
    const Tensor norms = sqrt(sum(reshape(square(n), {E, A * B}), 1));
    if (const int64_t bad = count_non_finite(norms); bad > 0)
      return NonFiniteTensor{p.name, p.tensor.shape(), bad * A * B};
    const double decay = 1.0 - lr * (p.decay ? options_.weight_decay : 0.0);
    const double step = lr * muon_update_scale(A, B) * 2.0;
    const double largest = w.dtype() == DType::f64 ? std::numeric_limits<double>::max()
                                                   : static_cast<double>(std::numeric_limits<float>::max());
    // bf16 parameters: the master's rounding must stay finite too (bf16's largest is just below f32's).
    const double limit = master_[i].defined() ? std::ldexp(1.99609375, 127) : largest;
    const double worst = muon_max_abs(w) * std::fabs(decay) + step;
    if (std::isfinite(worst) && worst < limit / 2) continue;
    // Near the limit: the update in full, counted.
    const Tensor x = newton_schulz(n, options_.ns_steps, options_.eps);
    Tensor next = add(mul_scalar(w, decay), mul_scalar(x, -lr * muon_update_scale(A, B)));
    if (master_[i].defined()) next = next.to(DType::bf16);
    if (const int64_t bad = count_non_finite(next); bad > 0) return NonFiniteTensor{p.name, p.tensor.shape(), bad};
  }
  return std::nullopt;
}

}  // namespace moetrain
