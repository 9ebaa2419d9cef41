// Named parameters: what optimizers, checkpoints and exporters iterate over.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

struct NamedParameter {
  std::string name;   // dotted, e.g. "h.3.attn.c_attn.weight" (GPT-2 uses Hugging Face names)
  Tensor tensor;      // a leaf with requires_grad
  bool decay = true;  // receives weight decay (matrices; not biases, norms, embeddings)
  std::string group;  // component for reports: "embedding", "attention", "mlp", "norm", ...
};
using ParameterList = std::vector<NamedParameter>;

int64_t count_parameters(const ParameterList& params);

// The first tensor of `params` (in order) holding a NaN or an infinity.
struct NonFiniteTensor {
  std::string name;
  Shape shape;
  int64_t count = 0;  // non-finite elements of that tensor
};
std::optional<NonFiniteTensor> find_non_finite(const ParameterList& params);
// "model.layers.0.mlp.w1.weight [64, 32]: 3 of 2048 values are NaN or infinite"
std::string describe(const NonFiniteTensor& t);

// Mixed precision (train.dtype bf16): the parameters that stay f32 while the rest
// become bf16 (docs/model.md#mixed-precision): the MoE router weight (logits, scores
// and top-k in f32) and the KDA layer's A_log, dt_bias, short-conv weights and
// output norm weight (the layer computes between its projections in f32).
bool stays_f32_in_mixed_precision(const NamedParameter& p);

// A hidden weight matrix: a linear map between hidden spaces, [out, in] or a batch
// of routed experts' [E, out, in]; what train.optimizer muon gives to Muon
// (docs/model.md#muon). Not: embeddings (rows read one token at a time), the LM
// head, the router gate, the short-convolution weights, and every 1-D parameter
// (norms, biases, KDA's A_log and dt_bias, AttnRes vectors).
bool is_hidden_matrix(const NamedParameter& p);
bool is_hidden_matrix(std::string_view name, std::string_view group, int64_t dim);

}  // namespace moetrain
