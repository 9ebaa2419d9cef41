#include "nn/language_model.h"

#include "autograd/profile.h"
#include "ops/softmax.h"

namespace moetrain {

Tensor LanguageModel::loss(const Tensor& ids, const Tensor& targets, bool training) {
  Tensor logits = forward(ids, training);
  profile::Region region("embedding/head");
  // Targets follow the logits (the trainer moves both; eval passes host batches).
  return cross_entropy(logits, targets.to(logits.device()));
}

}  // namespace moetrain
