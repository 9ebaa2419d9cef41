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
// Not wired into the trainer yet (train.optimizer is AdamW only; docs/model.md#muon).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"

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

class Muon {
 public:
  // Every parameter must be a matrix [A, B] or a batch [E, A, B] of f32, f64 or
  // bf16 (throws naming the parameter otherwise: 1-D parameters, embeddings, the LM
  // head and norms belong to AdamW, docs/model.md#muon). Parameters with
  // decay == false get no weight decay. Momentum buffers start at zero, in the
  // parameter's dtype (f32 for a bf16 parameter, whose f32 values become its master).
  Muon(const ParameterList& params, MuonOptions options);

  // One update with learning rate lr, using each parameter's grad() (parameters
  // without a gradient are skipped, their momentum untouched). The gradients are
  // the step's full accumulated gradients: call once per optimizer step, never per
  // micro-batch (the orthogonalisation is not linear).
  void step(double lr);
  // Drops all gradients (the next backward starts from zero).
  void zero_grad();

  int64_t steps() const { return step_; }
  void set_steps(int64_t steps) { step_ = steps; }
  const MuonOptions& options() const { return options_; }
  const ParameterList& parameters() const { return params_; }
  // Bytes of the momentum buffers and master copies this optimizer holds.
  int64_t state_bytes() const;
  // The momentum buffer M of each parameter, in parameter order, shaped as the
  // parameter (checkpoints); momentum(name) finds one by parameter name (throws
  // when no parameter has that name).
  std::vector<Tensor>& momentum_buffers() { return m_; }
  const std::vector<Tensor>& momentum_buffers() const { return m_; }
  const Tensor& momentum(const std::string& name) const;

  // Mixed precision, as AdamW::convert_to_bf16: each f32 parameter that `select`
  // picks becomes bf16 in place (every handle sees it; its gradient is dropped) and
  // its f32 values become the master copy. Its momentum must be f32.
  void convert_to_bf16(const std::function<bool(const NamedParameter&)>& select);
  // The f32 master copy of each parameter, in parameter order; undefined for a
  // parameter that is its own master.
  const std::vector<Tensor>& master_weights() const { return master_; }
  Tensor master_or_parameter(size_t i) const { return master_[i].defined() ? master_[i] : params_[i].tensor; }
  // After new master values were written (a checkpoint load, QK-Clip): each bf16
  // parameter becomes its master rounded to nearest even.
  void round_parameters_from_master();

 private:
  ParameterList params_;
  MuonOptions options_;
  std::vector<Tensor> m_, master_;
  int64_t step_ = 0;
};

}  // namespace moetrain
