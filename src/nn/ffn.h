// Dense feed-forward sublayers of the hybrid model (no biases, HF names):
//   situ_glu: y = SiTU(x Wgate^T, x Wup^T; β, λ) Wdown^T      docs/model.md#situ-glu (K3)
//   swiglu:   y = (silu(x Wgate^T) ⊙ x Wup^T) Wdown^T          Kimi-Linear
//   gelu:     y = gelu_tanh(x Wup^T) Wdown^T                    GPT-2-style MLP without biases
// gate_proj/up_proj [F, D], down_proj [D, F].
#pragma once

#include <string>

#include "core/tensor.h"
#include "nn/param_factory.h"

namespace moetrain {

enum class FfnKind { situ_glu, swiglu, gelu };

struct FfnConfig {
  int64_t d_model = 256;
  int64_t d_ff = 1024;
  FfnKind kind = FfnKind::situ_glu;
  double situ_beta = 4.0;
  double situ_linear_beta = 25.0;  // 0: no cap on `up`
  bool situ_learnable_beta = false;
  double init_std = 0.02;
  // train.recompute_modules act: the activation and the down-projection run again in
  // backward, so the F-wide activation is not kept (docs/training.md#activation-recomputation).
  bool recompute_act = false;
};

// The FFN sublayer of a decoder layer: a dense MLP (below) or an MoE layer (nn/moe.h).
class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // x [B, T, D] (the normed sublayer input) -> [B, T, D]. training: an MoE layer
  // counts its assignments and sets its auxiliary loss.
  virtual Tensor forward(const Tensor& x, bool training) = 0;
  // The component it is timed under (train.profile): "ffn" or "moe".
  virtual const char* component() const = 0;
};

class DenseFfn : public FeedForward {
 public:
  DenseFfn(const FfnConfig& c, ParamFactory& factory, const std::string& prefix, const std::string& group = "mlp");
  Tensor forward(const Tensor& x) const;
  Tensor forward(const Tensor& x, bool) override { return forward(x); }
  const char* component() const override { return "ffn"; }
  const FfnConfig& config() const { return c_; }

  Tensor gate_proj, up_proj, down_proj, beta;  // beta: [1] when learnable

 private:
  FfnConfig c_;
};

FfnKind parse_ffn_kind(const std::string& name);
const char* ffn_kind_name(FfnKind kind);

}  // namespace moetrain
