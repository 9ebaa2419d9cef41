// Muon (docs/model.md#muon): momentum, Newton-Schulz orthogonalisation and the
// update-RMS scale of Moonlight, per weight matrix W [A, B] (A output rows, B input
// columns) or per matrix of a batch [E, A, B] (routed experts: E matrices, never one
// (E·A)×B matrix). One step at learning rate η, weight decay λ, momentum μ:
//   M = μ M + G                                   (G: the gradient after clipping)
//   N = G + μ M (nesterov)  or  N = M
//   X = NS(N / (‖N‖_F + eps)), per matrix, on Nᵀ when A > B
//   W = W (1 − η λ) − η · 0.2 · √max(A, B) · X
// NS: ns_steps times X = a X + (b P + c P²) X with P = X Xᵀ,
// (a, b, c) = (3.4445, −4.7750, 2.0315).
//
// Built from the tensor ops (matmul, elementwise, sum), so the CPU runs the
// products through BLAS and CUDA through cuBLAS (batched GEMMs for [E, A, B]); the
// arithmetic is in the parameter's dtype (f32 or f64), or for a bf16 parameter in its
// f32 master (mixed precision as AdamW: the bf16 gradient widened to f32, master and
// momentum f32, the bf16 parameter rounded from the master to nearest even).
//
// train.optimizer: muon (optim/make_optimizer.h) chains it with AdamW: Muon on the
// hidden matrices, AdamW on the rest (docs/model.md#muon).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"
#include "optim/optimizer.h"

namespace moetrain {

// Every field has a range; validate() throws moetrain::Error naming the field.
struct MuonOptions {
  double momentum = 0.95;     // μ in [0, 1)
  bool nesterov = true;       // the orthogonalised input is G + μ M (else M)
  int64_t ns_steps = 5;       // Newton-Schulz iterations, >= 1
  double weight_decay = 0.1;  // λ >= 0 (decoupled, as AdamW: W (1 − η λ)); AdamW's default
  double eps = 1e-7;          // > 0, added to ‖N‖_F before dividing
};
void validate(const MuonOptions& options);

// The Newton-Schulz coefficients (Jordan et al., KellerJordan/Muon `muon.py`).
inline constexpr double kMuonNsA = 3.4445, kMuonNsB = -4.7750, kMuonNsC = 2.0315;

// The scale of the orthogonalised update of an A×B matrix: 0.2·√max(A, B)
// (Moonlight: an orthogonal A×B matrix has RMS 1/√max(A, B); this gives the
// update an RMS near 0.2, AdamW's, so AdamW's lr and weight decay carry over).
double muon_update_scale(int64_t rows, int64_t cols);

// NS(x / (‖x‖_F + eps)) per matrix: x [A, B] or [E, A, B] (f32 or f64, CPU or
// CUDA) -> the same shape and dtype. Works on xᵀ when A > B (the Gram matrix is
// min(A, B)²), expressed through matmul's transpose flags rather than copies. With
// input singular values s (normalised by the Frobenius norm) the output has
// φ^steps(s), φ(s) = a s + b s³ + c s⁵: for s in [0.003, 1] and 5 steps that is
// within [0.681, 1.203] (docs/model.md#muon). A zero matrix stays zero.
Tensor newton_schulz(const Tensor& x, int64_t steps, double eps = 1e-7);

// One Muon step on one parameter, in place: param and momentum are updated, grad
// is read. param [A, B] or [E, A, B], f32 or f64; grad and momentum the same
// shape, dtype and device. weight_decay is options.weight_decay (the caller passes
// 0 for a parameter without decay). lr must be finite and >= 0.
void muon_update(const Tensor& param, const Tensor& grad, const Tensor& momentum, double lr,
                 const MuonOptions& options);

// Slot (checkpoint group): "momentum" (M, the parameter's shape).
class Muon : public RuleOptimizer {
 public:
  // Every parameter must be a matrix [A, B] or a batch [E, A, B] of f32, f64 or
  // bf16 (throws naming the parameter otherwise: 1-D parameters, embeddings, the LM
  // head and norms belong to AdamW, docs/model.md#muon). Parameters with
  // decay == false get no weight decay. Momentum buffers start at zero, in the
  // parameter's dtype (f32 for a bf16 parameter, whose f32 values become its master).
  // With `shard` (train.zero 1) each range must be the whole parameter or empty:
  // Muon orthogonalises whole matrices, so a parameter is owned by one rank of its
  // replica group (train/distributed.h make_zero_shards); the others keep no
  // momentum or master for it and get its new values from the owner.
  Muon(const ParameterList& params, MuonOptions options, std::vector<ElementRange> shard = {});

  // One update with learning rate lr, using each parameter's grad() (parameters
  // without a gradient are skipped, their momentum untouched). The gradients are
  // the step's full accumulated gradients: call once per optimizer step, never per
  // micro-batch (the orthogonalisation is not linear).
  void step(double lr) override;
  // Whether step(lr) would keep every owned parameter and momentum finite, without
  // taking it (the Optimizer contract). The new momentum and Newton-Schulz input
  // are computed (two elementwise passes) and counted; their Frobenius norm must be
  // finite; then each new weight w (1 − η λ) − η s X is finite wherever
  // |w (1 − η λ)| + η s · 2 is below the dtype's largest value (X's entries are
  // bounded by its spectral norm, at most 1.21 for the band above: 2 leaves room for
  // rounding); a parameter with an entry outside that bound has its update computed
  // in full and counted.
  std::optional<NonFiniteTensor> non_finite_update(double lr) const override;

  const MuonOptions& options() const { return options_; }
  std::vector<std::string> slot_names() const override { return {"momentum"}; }
  Tensor slot(const std::string& name, size_t i) const override { return name == "momentum" ? m_[i] : Tensor(); }
  // The momentum buffer M of each parameter, in parameter order, shaped as the
  // parameter (undefined where this rank owns none of it); momentum(name) finds
  // one by parameter name (throws when no parameter has that name).
  std::vector<Tensor>& momentum_buffers() { return m_; }
  const std::vector<Tensor>& momentum_buffers() const { return m_; }
  const Tensor& momentum(const std::string& name) const;

 protected:
  // A whole parameter keeps its shape (the rule works on matrices); undefined when not owned.
  Tensor state_view(size_t i, const Tensor& t) const override;

 private:
  MuonOptions options_;
  std::vector<Tensor> m_;
};

}  // namespace moetrain
