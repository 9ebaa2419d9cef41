#include "optim/adamw.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "core/grad_mode.h"
#include "optim/adamw_kernels.h"

namespace moetrain {

namespace {

// A gradient element in the update's arithmetic type: a bf16 gradient widened
// to f32 (exact), else as it is.
template <class T> inline T widen(T g) { return g; }
inline float widen(bf16 g) { return g.to_float(); }

// The smallest f32 whose bf16 rounding (to nearest even) is infinite: halfway
// between bf16's largest value (2^127 * 1.9921875) and 2^128.
const double kBf16Infinite = std::ldexp(1.99609375, 127);

// One pass over [lo, hi) of one parameter: adamw_element (adamw_kernels.h) for
// each element, stored. w is the parameter (T = its dtype, G = T) or, in mixed
// precision, its f32 master (T = float, G = bf16), whose rounding to nearest
// even goes to the bf16 parameter w16 (unused otherwise). The pointers do not
// alias (restrict), so the loop vectorises; target_clones compiles it for
// AVX2 + FMA as well and picks the version by CPUID at load time. The AVX2 clone
// contracts multiply-adds into FMAs, so results differ in the last bits between
// CPUs with and without it (the same CPU always gives the same bits). A bf16
// parameter's master follows an f32 parameter bit for bit: the same loop body
// on the same (widened) gradient values.
template <class T, class G>
__attribute__((target_clones("arch=x86-64-v3", "default"))) void adamw_update(
    T* __restrict w, bf16* __restrict w16, const G* __restrict g, T* __restrict m, T* __restrict v, int64_t lo,
    int64_t hi, const AdamWCoefficients& k) {
  const AdamWScalars<T> c(k);
  for (int64_t j = lo; j < hi; ++j) {
    const AdamWElement<T> u = adamw_element<T>(w[j], widen(g[j]), m[j], v[j], c);
    m[j] = u.m;
    v[j] = u.v;
    w[j] = u.w;
    if constexpr (std::is_same_v<G, bf16>) w16[j] = bf16::from_float(u.w);
  }
}

// non_finite_update's pass over [lo, hi): the loop above with the stores
// replaced by a count of the elements whose new w, m or v (or bf16 rounding of
// the master) would be NaN or infinite. Same clones, same inlined element code,
// so the count is of the values adamw_update would store.
template <class T, class G>
__attribute__((target_clones("arch=x86-64-v3", "default"))) int64_t adamw_count_non_finite(
    const T* __restrict w, const G* __restrict g, const T* __restrict m, const T* __restrict v, int64_t lo,
    int64_t hi, const AdamWCoefficients& k) {
  const AdamWScalars<T> c(k);
  int64_t bad = 0;
  for (int64_t j = lo; j < hi; ++j) {
    const AdamWElement<T> u = adamw_element<T>(w[j], widen(g[j]), m[j], v[j], c);
    bool finite = std::isfinite(u.w) & std::isfinite(u.m) & std::isfinite(u.v);
    if constexpr (std::is_same_v<G, bf16>) finite &= std::isfinite(bf16::from_float(u.w).to_float());
    bad += !finite;
  }
  return bad;
}

// Input bounds within which an element's update is finite however it rounds,
// so that non_finite_update can skip the exact arithmetic where every input of
// a chunk is inside them (everywhere, in a healthy run): the two divisions and
// the square root per element are what limits the step's speed on the CPU (a
// check doing them all costs as much as the step). With L the dtype's largest
// value, Lw the largest new w allowed (L, or for a bf16 master the smallest f32
// whose bf16 rounding is infinite), u the unit roundoff, and coefficients as
// the loops convert them to T:
//   |w| <= Lw / (4 |decay|), |m| <= Lw eps / (4 |step_size|), |g| <= that and
//   <= sqrt(L / 4), 0 <= v <= L / 4
// give |m'| <= max(|m|, |g|)(1 + 3u) and v' <= max(v, g^2)(1 + 3u), both well
// below L; the denominator sqrt(v') / bc2 + eps is >= eps (rounding is monotonic),
// so |step| <= Lw / 4 (1 + 7u) and |w decay| <= Lw / 4 (1 + 2u), and |w'| <= Lw / 2
// (1 + 8u) < Lw, with or without fused multiply-adds. Every limit is at most
// L / 4, so an infinite or NaN input is never inside. `on` is false (all exact)
// when a coefficient is not finite.
template <class T> struct SafeInputs {
  T w, m, g, v;
  bool on;
};
template <class T> SafeInputs<T> safe_inputs(const AdamWCoefficients& k, double largest_w) {
  const AdamWScalars<T> c(k);
  const double quarter = static_cast<double>(std::numeric_limits<T>::max()) / 4;
  const double decay = std::fabs(static_cast<double>(c.decay)), step = std::fabs(static_cast<double>(c.step_size));
  const double eps = c.eps, bc = c.bc2_sqrt, b1 = c.b1, b2 = c.b2;
  SafeInputs<T> s{};
  s.on = std::isfinite(decay) && std::isfinite(step) && std::isfinite(b1) && std::isfinite(b2) && std::isfinite(bc) &&
         bc > 0 && std::isfinite(eps) && eps > 0;
  if (!s.on) return s;
  // x / 0 is infinite, then the quarter bounds it.
  s.w = static_cast<T>(std::min(largest_w / 4 / decay, quarter));
  s.m = static_cast<T>(std::min(largest_w / 4 * eps / step, quarter));
  s.g = static_cast<T>(std::min(static_cast<double>(s.m), std::sqrt(quarter)));
  s.v = static_cast<T>(quarter);
  return s;
}

// Whether any element of [lo, hi) has an input outside `s` (NaN included).
template <class T, class G>
__attribute__((target_clones("arch=x86-64-v3", "default"))) bool any_outside(
    const T* __restrict w, const G* __restrict g, const T* __restrict m, const T* __restrict v, int64_t lo,
    int64_t hi, const SafeInputs<T>& s) {
  const T sw = s.w, sm = s.m, sg = s.g, sv = s.v;
  int outside = 0;
  for (int64_t j = lo; j < hi; ++j) {
    const T gj = widen(g[j]);
    const bool inside = (std::fabs(w[j]) <= sw) & (std::fabs(m[j]) <= sm) & (std::fabs(gj) <= sg) & (v[j] >= T(0)) &
                        (v[j] <= sv);
    outside |= !inside;
  }
  return outside != 0;
}

// non_finite_update's count over [lo, hi), chunk by chunk: a chunk whose inputs
// are all inside the safe bounds has none; any other is counted exactly.
template <class T, class G>
int64_t count_non_finite_updates(const T* w, const G* g, const T* m, const T* v, int64_t lo, int64_t hi,
                                 const AdamWCoefficients& k, const SafeInputs<T>& s) {
  constexpr int64_t kChunk = 4096;  // its inputs stay in L2 for the exact pass
  int64_t bad = 0;
  for (int64_t c = lo; c < hi; c += kChunk) {
    const int64_t e = std::min(hi, c + kChunk);
    if (s.on && !any_outside<T, G>(w, g, m, v, c, e, s)) continue;
    bad += adamw_count_non_finite<T, G>(w, g, m, v, c, e, k);
  }
  return bad;
}

// What step t (1-based) with learning rate lr uses for parameter p: nullopt when
// p has no gradient (skipped), else its gradient in `grad` and the coefficients.
// A parameter with a master (`mixed`) must have a bf16 gradient of its shape on
// its device. step() and non_finite_update() both start here.
std::optional<AdamWCoefficients> prepare(const NamedParameter& p, bool mixed, const AdamWOptions& o, double lr,
                                         int64_t t, Tensor& grad) {
  grad = p.tensor.grad();
  if (!grad.defined()) return std::nullopt;
  if (mixed)
    MT_CHECK(grad.dtype() == DType::bf16 && grad.device() == p.tensor.device() && grad.shape() == p.tensor.shape(),
             "adamw: {} is {} but its gradient is {}; expected a bf16 gradient of the same shape and device", p.name,
             describe(p.tensor), describe(grad));
  const double b1 = o.beta1, b2 = o.beta2;
  const double step_size = lr / (1.0 - std::pow(b1, static_cast<double>(t)));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(t)));
  const double decay = p.decay ? 1.0 - lr * o.weight_decay : 1.0;
  return AdamWCoefficients{decay, b1, b2, step_size, bc2_sqrt, o.eps};
}

}  // namespace

AdamW::AdamW(const ParameterList& params, AdamWOptions options, std::vector<ElementRange> shard)
    : RuleOptimizer("adamw", params, std::move(shard)), options_(options) {
  MT_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
           "adamw: betas ({}, {}) must be in [0, 1)", options.beta1, options.beta2);
  MT_CHECK(options.eps > 0 && options.weight_decay >= 0, "adamw: eps = {} must be > 0 and weight_decay = {} >= 0",
           options.eps, options.weight_decay);
  NoGradGuard no_grad;
  make_masters();  // a parameter that is bf16 already gets its f32 master from its own values (exact)
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor own = master_[i].defined() ? master_[i] : owned_part(i, params_[i].tensor.detach());
    m_.push_back(zeros_like(own));
    v_.push_back(zeros_like(own));
  }
}

Tensor AdamW::slot(const std::string& name, size_t i) const {
  if (name == "exp_avg") return m_[i];
  if (name == "exp_avg_sq") return v_[i];
  return {};
}

void AdamW::step(double lr) {
  NoGradGuard no_grad;
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParameter& p = params_[i];
    Tensor g;
    const std::optional<AdamWCoefficients> k = prepare(p, master_[i].defined(), options_, lr, step_, g);
    if (!k || owned(i).size() == 0) continue;
    Tensor w = owned_part(i, p.tensor.detach());
    g = owned_part(i, g);
    if (master_[i].defined()) {
      if (w.is_cuda()) {
        cuda::adamw_update_bf16_master(w, g, master_[i], m_[i], v_[i], *k);
        continue;
      }
      bf16* pw = w.data<bf16>();
      const bf16* pg = g.data<bf16>();
      float *pm = master_[i].data<float>(), *m = m_[i].data<float>(), *v = v_[i].data<float>();
      cpu::parallel_for(w.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
        adamw_update<float, bf16>(pm, pw, pg, m, v, lo, hi, *k);
      });
      continue;
    }
    if (w.is_cuda()) {
      cuda::adamw_update(w, g, m_[i], v_[i], *k);
      continue;
    }
    dispatch_float(w.dtype(), "adamw", [&](auto tag) {
      using T = decltype(tag);
      T* pw = w.data<T>();
      const T* pg = g.data<T>();
      T *m = m_[i].data<T>(), *v = v_[i].data<T>();
      cpu::parallel_for(w.numel(), 1 << 14,
                        [&](int64_t lo, int64_t hi) { adamw_update<T, T>(pw, nullptr, pg, m, v, lo, hi, *k); });
    });
  }
}

std::optional<NonFiniteTensor> AdamW::non_finite_update(double lr) const {
  NoGradGuard no_grad;
  const int64_t t = step_ + 1;  // what step() will count this update as
  std::vector<int64_t> counts(params_.size(), 0);
  Tensor device_counts;  // [params] i64 on the CUDA device, read once at the end
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParameter& p = params_[i];
    Tensor g;
    const std::optional<AdamWCoefficients> k = prepare(p, master_[i].defined(), options_, lr, t, g);
    if (!k || owned(i).size() == 0) continue;
    const Tensor w = owned_part(i, p.tensor.detach());
    g = owned_part(i, g);
    if (w.is_cuda()) {
      if (!device_counts.defined())
        device_counts = zeros({static_cast<int64_t>(params_.size())}, DType::i64, p.tensor.device());
      MT_CHECK(device_counts.device() == p.tensor.device(),
               "adamw: parameters on {} and {}; one device per process", device_counts.device(), p.tensor.device());
      if (master_[i].defined())
        cuda::adamw_count_non_finite_bf16_master(device_counts, static_cast<int64_t>(i), g, master_[i], m_[i], v_[i],
                                                 *k);
      else
        cuda::adamw_count_non_finite(device_counts, static_cast<int64_t>(i), w, g, m_[i], v_[i], *k);
      continue;
    }
    std::atomic<int64_t> bad{0};
    if (master_[i].defined()) {
      const bf16* pg = g.data<bf16>();
      const float *pm = master_[i].data<float>(), *m = m_[i].data<float>(), *v = v_[i].data<float>();
      const SafeInputs<float> safe = safe_inputs<float>(*k, kBf16Infinite);
      cpu::parallel_for(w.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
        bad += count_non_finite_updates<float, bf16>(pm, pg, m, v, lo, hi, *k, safe);
      });
    } else {
      dispatch_float(w.dtype(), "adamw", [&](auto tag) {
        using T = decltype(tag);
        const T *pw = w.data<T>(), *pg = g.data<T>(), *m = m_[i].data<T>(), *v = v_[i].data<T>();
        const SafeInputs<T> safe = safe_inputs<T>(*k, static_cast<double>(std::numeric_limits<T>::max()));
        cpu::parallel_for(w.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
          bad += count_non_finite_updates<T, T>(pw, pg, m, v, lo, hi, *k, safe);
        });
      });
    }
    counts[i] = bad.load();
    // No CUDA parameter before this one: it is the first with a non-finite update.
    if (counts[i] > 0 && !device_counts.defined()) return NonFiniteTensor{p.name, p.tensor.shape(), counts[i]};
  }
  if (device_counts.defined()) {
    const Tensor on_host = device_counts.to(kCpu);  // the one wait for the device
    const int64_t* c = on_host.data<int64_t>();
    for (size_t i = 0; i < params_.size(); ++i) counts[i] += c[i];
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (counts[i] > 0) return NonFiniteTensor{params_[i].name, params_[i].tensor.shape(), counts[i]};
  return std::nullopt;
}

double grad_squared_sum_from(double start, const std::vector<Tensor>& parts) {
  double total = start;
  Tensor device_total;  // CUDA grads add into one f64 on their device: one wait at the end
  for (const Tensor& g : parts) {
    if (!g.defined()) continue;
    if (g.is_cuda()) {
      if (!device_total.defined()) device_total = zeros({1}, DType::f64, g.device());
      MT_CHECK(device_total.device() == g.device(), "clip_grad_norm: gradients on {} and {}; one device per process",
               device_total.device(), g.device());
      cuda::add_squared_sum(device_total, g);
      continue;
    }
    if (g.dtype() == DType::bf16) {  // mixed precision: bf16 grads widened, summed in double
      const bf16* d = g.data<bf16>();
      for (int64_t j = 0; j < g.numel(); ++j) total += static_cast<double>(d[j].to_float()) * d[j].to_float();
      continue;
    }
    dispatch_float(g.dtype(), "clip_grad_norm", [&](auto tag) {
      using T = decltype(tag);
      const T* d = g.data<T>();
      for (int64_t j = 0; j < g.numel(); ++j) total += static_cast<double>(d[j]) * d[j];
    });
  }
  if (device_total.defined()) total += device_total.item<double>();
  return total;
}

double grad_squared_sum(const ParameterList& params) {
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (const NamedParameter& p : params) grads.push_back(p.tensor.grad());
  return grad_squared_sum_from(0.0, grads);
}

void scale_grad_parts(const std::vector<Tensor>& parts, double coef) {
  for (Tensor g : parts) {
    if (!g.defined()) continue;
    if (g.is_cuda()) {
      cuda::scale(g, coef);
      continue;
    }
    if (g.dtype() == DType::bf16) {  // in f32, rounded back (as the CUDA kernel)
      bf16* d = g.data<bf16>();
      const float c = static_cast<float>(coef);
      for (int64_t j = 0; j < g.numel(); ++j) d[j] = bf16::from_float(d[j].to_float() * c);
      continue;
    }
    dispatch_float(g.dtype(), "clip_grad_norm", [&](auto tag) {
      using T = decltype(tag);
      T* d = g.data<T>();
      T c = static_cast<T>(coef);
      cpu::parallel_for(g.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) d[j] *= c;
      });
    });
  }
}

void scale_grads(const ParameterList& params, double coef) {
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (const NamedParameter& p : params) grads.push_back(p.tensor.grad());
  scale_grad_parts(grads, coef);
}

double clip_grad_norm(const ParameterList& params, double max_norm) {
  const double norm = std::sqrt(grad_squared_sum(params));
  if (max_norm > 0 && norm > max_norm) scale_grads(params, max_norm / (norm + 1e-6));
  return norm;
}

}  // namespace moetrain
