#include "nn/ffn.h"

#include <optional>

#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/situ/situ.h"

namespace moetrain {

DenseFfn::DenseFfn(const FfnConfig& c, ParamFactory& f, const std::string& p, const std::string& group) : c_(c) {
  const Init w = Init::trunc_normal(c.init_std);
  if (c.kind != FfnKind::gelu) gate_proj = f.make(p + "gate_proj.weight", {c.d_ff, c.d_model}, w, group, true);
  up_proj = f.make(p + "up_proj.weight", {c.d_ff, c.d_model}, w, group, true);
  down_proj = f.make(p + "down_proj.weight", {c.d_model, c.d_ff}, w, group, true);
  if (c.kind == FfnKind::situ_glu && c.situ_learnable_beta)
    beta = f.make(p + "situ_beta", {1}, Init::constant(c.situ_beta), group, false);
}

Tensor DenseFfn::forward(const Tensor& x) const {
  switch (c_.kind) {
    case FfnKind::situ_glu: {
      std::optional<double> lambda;
      if (c_.situ_linear_beta > 0) lambda = c_.situ_linear_beta;
      Tensor a = beta.defined() ? situ_glu(linear(x, gate_proj), linear(x, up_proj), beta, lambda)
                                : situ_glu(linear(x, gate_proj), linear(x, up_proj), c_.situ_beta, lambda);
      return linear(a, down_proj);
    }
    case FfnKind::swiglu: return linear(mul(silu(linear(x, gate_proj)), linear(x, up_proj)), down_proj);
    case FfnKind::gelu: return linear(gelu_tanh(linear(x, up_proj)), down_proj);
  }
  return Tensor();
}

FfnKind parse_ffn_kind(const std::string& name) {
  if (name == "situ_glu") return FfnKind::situ_glu;
  if (name == "swiglu") return FfnKind::swiglu;
  if (name == "gelu") return FfnKind::gelu;
  MT_THROW("unknown FFN kind '{}' (situ_glu, swiglu, gelu)", name);
}

const char* ffn_kind_name(FfnKind kind) {
  switch (kind) {
    case FfnKind::situ_glu: return "situ_glu";
    case FfnKind::swiglu: return "swiglu";
    case FfnKind::gelu: return "gelu";
  }
  return "?";
}

}  // namespace moetrain
