// QK-Clip's row scaling (qk_clip.h has the layouts, docs/model.md#qk-clip the math).
// Rows of a row-major [R, C] weight are contiguous, so each head's block is an
// alias of the weight's storage, scaled in place through mul_scalar and copy_.
#include "optim/qk_clip.h"

#include <cmath>
#include <string>

#include "core/grad_mode.h"
#include "ops/elementwise/elementwise.h"

namespace moetrain {

namespace {

// Rows [first, first + count) of t ([R, C], or [R] for a bias) times s, in place.
void scale_rows_(const Tensor& t, int64_t first, int64_t count, double s) {
  if (count == 0) return;
  const int64_t cols = t.dim() == 2 ? t.size(1) : 1;
  const Tensor rows = alias(t.detach(), t.dim() == 2 ? Shape{count, cols} : Shape{count}, first * cols);
  if (rows.dtype() == DType::bf16) copy_(rows, mul_scalar(rows.to(DType::f32), s).to(DType::bf16));
  else copy_(rows, mul_scalar(rows, s));
}

void check_weight(const char* op, const char* what, const Tensor& t, int64_t rows) {
  MT_CHECK(t.defined() && t.dim() == 2 && t.size(0) == rows &&
               (t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::bf16),
           "{}: {} is {}; expected an f32, f64 or bf16 weight of {} rows ([rows, in])", op, what,
           t.defined() ? describe(t) : std::string("undefined"), rows);
}

void check_bias(const char* op, const char* what, const Tensor& b, const Tensor& w) {
  if (!b.defined()) return;
  MT_CHECK(b.shape() == Shape{w.size(0)} && b.dtype() == w.dtype() && b.device() == w.device(),
           "{}: {} is {} but its weight is {}; expected [{}] of the same dtype and device", op, what, describe(b),
           describe(w), w.size(0));
}

void check_gamma(const char* op, const std::vector<double>& gamma, int64_t n_head) {
  MT_CHECK(n_head >= 1 && static_cast<int64_t>(gamma.size()) == n_head, "{}: {} factors for n_head = {}", op,
           gamma.size(), n_head);
  for (size_t h = 0; h < gamma.size(); ++h)
    MT_CHECK(gamma[h] > 0 && gamma[h] <= 1, "{}: gamma of head {} is {}; expected (0, 1] (qk_clip_factors)", op, h,
             gamma[h]);
}

}  // namespace

std::vector<double> qk_clip_factors(const Tensor& max_logit, double tau) {
  MT_CHECK(std::isfinite(tau) && tau > 0, "qk_clip: tau = {} must be finite and > 0 (100 is the usual value)", tau);
  MT_CHECK(max_logit.defined() && max_logit.dim() == 1,
           "qk_clip: max_logit is {}; expected one value per head [H]",
           max_logit.defined() ? describe(max_logit) : std::string("undefined"));
  const std::vector<double> s = max_logit.to_vector();
  std::vector<double> gamma(s.size(), 1.0);
  for (size_t h = 0; h < s.size(); ++h) {
    if (std::isnan(s[h]) || s[h] == INFINITY)
      throw NumericalError(fmt::format("qk_clip: the max logit of head {} is {}; the attention logits are not finite",
                                       h, s[h]));
    if (s[h] > tau) gamma[h] = tau / s[h];
  }
  return gamma;
}

namespace {

// Calls scale(h, gamma_h, sqrt(gamma_h)) for each head with gamma_h != 1 (no
// gradient recorded), and returns how many heads that was: heads at or below tau
// are never touched, so they keep their bits.
template <class Scale>
int64_t clip_heads(const std::vector<double>& gamma, Scale&& scale) {
  NoGradGuard no_grad;
  int64_t clipped = 0;
  for (size_t h = 0; h < gamma.size(); ++h) {
    if (gamma[h] == 1.0) continue;
    scale(static_cast<int64_t>(h), gamma[h], std::sqrt(gamma[h]));
    ++clipped;
  }
  return clipped;
}

}  // namespace

int64_t qk_clip_mla_(const Tensor& q_weight, const Tensor& kv_b_weight, const std::vector<double>& gamma,
                     const MlaHeadDims& d) {
  const char* op = "qk_clip (mla)";
  MT_CHECK(d.n_head >= 1 && d.qk_nope_head_dim >= 0 && d.qk_rope_head_dim >= 0 && d.v_head_dim >= 0,
           "{}: n_head = {}, qk_nope_head_dim = {}, qk_rope_head_dim = {}, v_head_dim = {}; expected n_head >= 1 and "
           "head dims >= 0",
           op, d.n_head, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim);
  const int64_t H = d.n_head, dn = d.qk_nope_head_dim, dr = d.qk_rope_head_dim, dv = d.v_head_dim;
  check_weight(op, "q_b_proj.weight (or q_proj.weight)", q_weight, H * (dn + dr));
  check_weight(op, "kv_b_proj.weight", kv_b_weight, H * (dn + dv));
  check_gamma(op, gamma, H);
  return clip_heads(gamma, [&](int64_t h, double g, double root) {
    scale_rows_(q_weight, h * (dn + dr), dn, root);     // q_nope
    scale_rows_(q_weight, h * (dn + dr) + dn, dr, g);   // q_rot
    scale_rows_(kv_b_weight, h * (dn + dv), dn, root);  // k_nope; the dv value rows stay
  });
}

int64_t qk_clip_mha_(const Tensor& q_weight, const Tensor& k_weight, const std::vector<double>& gamma,
                     int64_t n_head, const Tensor& q_bias, const Tensor& k_bias) {
  const char* op = "qk_clip (attention)";
  MT_CHECK(n_head >= 1 && q_weight.defined() && q_weight.dim() == 2 && q_weight.size(0) % n_head == 0,
           "{}: q_proj.weight is {}; expected [H·hd, in] with H = n_head = {}", op,
           q_weight.defined() ? describe(q_weight) : std::string("undefined"), n_head);
  const int64_t rows = q_weight.size(0), hd = rows / n_head;
  check_weight(op, "q_proj.weight", q_weight, rows);
  check_weight(op, "k_proj.weight", k_weight, rows);
  check_bias(op, "q_proj.bias", q_bias, q_weight);
  check_bias(op, "k_proj.bias", k_bias, k_weight);
  check_gamma(op, gamma, n_head);
  return clip_heads(gamma, [&](int64_t h, double, double root) {
    for (const Tensor& t : {q_weight, k_weight, q_bias, k_bias})
      if (t.defined()) scale_rows_(t, h * hd, hd, root);
  });
}

int64_t qk_clip_fused_qkv_(const Tensor& c_attn_weight, const Tensor& c_attn_bias, const std::vector<double>& gamma,
                           int64_t n_head) {
  const char* op = "qk_clip (gpt2)";
  MT_CHECK(n_head >= 1 && c_attn_weight.defined() && c_attn_weight.dim() == 2 &&
               c_attn_weight.size(0) % (3 * n_head) == 0,
           "{}: attn.c_attn.weight is {}; expected [3D, in] ([q | k | v] rows) with D divisible by n_head = {}", op,
           c_attn_weight.defined() ? describe(c_attn_weight) : std::string("undefined"), n_head);
  const int64_t D = c_attn_weight.size(0) / 3, hd = D / n_head;
  check_weight(op, "attn.c_attn.weight", c_attn_weight, 3 * D);
  check_bias(op, "attn.c_attn.bias", c_attn_bias, c_attn_weight);
  check_gamma(op, gamma, n_head);
  return clip_heads(gamma, [&](int64_t h, double, double root) {
    for (const int64_t first : {h * hd, D + h * hd}) {  // the query rows, the key rows
      scale_rows_(c_attn_weight, first, hd, root);
      if (c_attn_bias.defined()) scale_rows_(c_attn_bias, first, hd, root);
    }
  });
}

}  // namespace moetrain
