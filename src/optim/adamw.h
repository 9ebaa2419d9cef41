// AdamW (Loshchilov & Hutter; PyTorch torch.optim.AdamW, same order of
// operations): decoupled weight decay p -= lr·wd·p, then
//   m = β1 m + (1-β1) g,  v = β2 v + (1-β2) g²,
//   p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps).
// Moments have the parameter's dtype (fp32 master weights in fp32 training).
#pragma once

#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"

namespace moetrain {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

class AdamW {
 public:
  // Parameters with decay == false get no weight decay.
  AdamW(const ParameterList& params, AdamWOptions options);

  // One update with learning rate lr, using each parameter's grad()
  // (parameters without a gradient are skipped, their moments untouched).
  void step(double lr);
  // Drops all gradients (the next backward starts from zero).
  void zero_grad();

  int64_t steps() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  // Moment tensors, in parameter order (checkpoints).
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  void set_steps(int64_t steps) { step_ = steps; }

 private:
  ParameterList params_;
  AdamWOptions options_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
};

// Global L2 norm of all gradients (accumulated in double); when max_norm > 0 and
// the norm exceeds it, scales every gradient by max_norm / (norm + 1e-6), as
// torch.nn.utils.clip_grad_norm_. Returns the norm before clipping.
double clip_grad_norm(const ParameterList& params, double max_norm);
// Its pieces, for a norm summed over ranks: the sum of squares of the defined
// grads, and grad *= coef.
double grad_squared_sum(const ParameterList& params);
void scale_grads(const ParameterList& params, double coef);

}  // namespace moetrain
