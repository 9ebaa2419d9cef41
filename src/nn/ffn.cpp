#include "nn/ffn.h"

#include <optional>

#include "autograd/engine.h"
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
  // The activation and the down-projection on [gate, up] (gelu: [up]); under
  // recompute_act one checkpoint() around them, so the activation is not kept.
  auto act_down = [this](const Tensors& in) {
    Tensor a;
    switch (c_.kind) {
      case FfnKind::situ_glu: {
        std::optional<double> lambda;
        if (c_.situ_linear_beta > 0) lambda = c_.situ_linear_beta;
        a = beta.defined() ? situ_glu(in[0], in[1], beta, lambda) : situ_glu(in[0], in[1], c_.situ_beta, lambda);
        break;
      }
      case FfnKind::swiglu: a = mul(silu(in[0]), in[1]); break;
      case FfnKind::gelu: a = gelu_tanh(in[0]); break;
    }
    return Tensors{linear(a, down_proj)};
  };
  const Tensors in = c_.kind == FfnKind::gelu ? Tensors{linear(x, up_proj)}
                                               : Tensors{linear(x, gate_proj), linear(x, up_proj)};
  return (c_.recompute_act ? checkpoint(act_down, in) : act_down(in))[0];
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
