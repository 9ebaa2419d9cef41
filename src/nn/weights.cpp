#include "nn/weights.h"

#include <set>

#include "checkpoint/safetensors.h"
#include "core/grad_mode.h"
#include "core/tensor.h"

namespace moetrain {

void save_weights(const ParameterList& params, const std::string& path) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  NoGradGuard no_grad;
  for (const NamedParameter& p : params) tensors.emplace_back(p.name, p.tensor.detach().to(DType::f32));
  write_safetensors(path, tensors);
}

void load_weights(ParameterList& params, const std::string& path) {
  SafetensorsFile file = SafetensorsFile::open(path);
  std::set<std::string> used;
  NoGradGuard no_grad;
  for (NamedParameter& p : params) {
    MT_CHECK(file.contains(p.name), "{}: missing tensor {} {} (the weights belong to another architecture or size)",
             path, p.name, p.tensor.shape());
    const TensorEntry& e = file.entry(p.name);
    MT_CHECK(e.shape == p.tensor.shape(), "{}: tensor {} is {} but the model expects {}", path, p.name, e.shape,
             p.tensor.shape());
    copy_(p.tensor, file.read(p.name).to(p.tensor.dtype()));
    used.insert(p.name);
  }
  for (const TensorEntry& e : file.entries())
    MT_CHECK(used.count(e.name), "{}: unexpected tensor {} {} (not part of this model)", path, e.name, e.shape);
}

}  // namespace moetrain
