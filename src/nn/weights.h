// A model's parameters as one safetensors file under our own names (the models
// that have no Hugging Face layout to follow, e.g. the hybrid). Loading is
// strict: every parameter must be present with its shape, and nothing else.
#pragma once

#include <string>

#include "nn/parameters.h"

namespace moetrain {

// Writes every parameter as f32 (atomically: see write_safetensors).
void save_weights(const ParameterList& params, const std::string& path);
// Copies the tensors of `path` into `params` (converting dtypes); errors name the
// file and the tensor.
void load_weights(ParameterList& params, const std::string& path);

}  // namespace moetrain
