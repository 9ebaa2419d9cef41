// Named parameters: what optimizers, checkpoints and exporters iterate over.
#pragma once

#include <string>
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

}  // namespace moetrain
