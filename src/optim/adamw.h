// AdamW (Loshchilov & Hutter; PyTorch torch.optim.AdamW, same order of
// operations): decoupled weight decay p -= lr·wd·p, then
//   m = β1 m + (1-β1) g,  v = β2 v + (1-β2) g²,
//   p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps).
// Moments have the parameter's dtype (fp32 master weights in fp32 training).
//
// Mixed precision (train.dtype bf16, docs/cuda.md): convert_to_bf16 turns the
// chosen parameters into bf16 and keeps their f32 values as master weights; for
// those, a step converts the bf16 gradient to f32, updates master and f32 moments
// exactly as an f32 parameter would be updated, and writes the master rounded to
// nearest even into the bf16 parameter.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"
#include "optim/optimizer.h"

namespace moetrain {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

// Slots (checkpoint groups): "exp_avg" (m) and "exp_avg_sq" (v).
class AdamW : public RuleOptimizer {
 public:
  // Parameters with decay == false get no weight decay. With `shard` (one range
  // per parameter; train.zero 1) the optimizer owns only those elements: its
  // moments and master copies are flat [end - begin] tensors, step() updates only
  // those elements of each parameter (reading the same elements of its
  // gradient), and the caller gathers the rest from the ranks that own them.
  // Without, every element ([0, numel)), moments of the parameter's shape.
  AdamW(const ParameterList& params, AdamWOptions options, std::vector<ElementRange> shard = {});

  // One update with learning rate lr, using each parameter's grad()
  // (parameters without a gradient are skipped, their moments untouched).
  void step(double lr) override;
  // Whether the next step(lr) would keep every value finite, without taking it:
  // computes what step(lr) would (step t = steps() + 1, the same coefficients and
  // the same per-element code, CPU clone and multiply-add contraction, so the
  // verdict matches the update bit for bit) for each parameter's new value (in
  // mixed precision its f32 master and the master's bf16 rounding), m and v, and
  // writes nothing. Returns the first parameter, in order, with a new value that
  // would be NaN or infinite, and how many of its elements would be; nullopt when
  // all stay finite. Parameters without a gradient are skipped, as step() skips
  // them. Cost (bench/ops_bench.cpp BM_adamw_*): one read-only pass over
  // parameters, gradients and moments; on the CPU a chunk whose inputs are all
  // inside bounds that make the update finite skips the arithmetic (adamw.cpp,
  // SafeInputs), so the pass is bound by memory reads; on CUDA one count kernel
  // per parameter and one device-to-host read per call.
  //
  // The caller's contract (the trainer): call it after the gradient checks and
  // clipping, with the lr it will pass to step(); all-reduce the verdict across
  // ranks (ranks may hold different parameters, e.g. experts); then every rank
  // either calls step(lr) or, when any rank found a non-finite update, skips the
  // step (no step(), so steps() and the moments stay as they were) and counts it
  // as it counts a non-finite gradient. Gradients, parameters, moments and
  // steps() must not change between this call and step(lr).
  std::optional<NonFiniteTensor> non_finite_update(double lr) const override;

  const AdamWOptions& options() const { return options_; }
  std::vector<std::string> slot_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  Tensor slot(const std::string& name, size_t i) const override;
  // Moment tensors, in parameter order.
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  // Mixed precision (convert_to_bf16, master_weights, round_parameters_from_master:
  // optim/optimizer.h): the f32 master of each parameter (sharded: of its owned
  // elements, flat); the moments must be f32.

 private:
  AdamWOptions options_;
  std::vector<Tensor> m_, v_;
};

// Global L2 norm of all gradients (accumulated in double); when max_norm > 0 and
// the norm exceeds it, scales every gradient by max_norm / (norm + 1e-6), as
// torch.nn.utils.clip_grad_norm_. Returns the norm before clipping.
double clip_grad_norm(const ParameterList& params, double max_norm);
// Its pieces, for a norm summed over ranks: the sum of squares of the defined
// grads, and grad *= coef.
double grad_squared_sum(const ParameterList& params);
void scale_grads(const ParameterList& params, double coef);
// The same over parts of the grads (train.zero 1): `parts[k]` is the flat
// slice of params[k]'s grad to use (undefined: skip; see AdamW::owned_part).
// The sum is the sequential fold of grad_squared_sum, continued from `start`
// (on the CPU: the same bits as folding the whole in one go).
double grad_squared_sum_from(double start, const std::vector<Tensor>& parts);
void scale_grad_parts(const std::vector<Tensor>& parts, double coef);

}  // namespace moetrain
