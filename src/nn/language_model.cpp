#include "nn/language_model.h"

#include "ops/softmax.h"

namespace moetrain {

Tensor LanguageModel::loss(const Tensor& ids, const Tensor& targets, bool training) {
  return cross_entropy(forward(ids, training), targets);
}

}  // namespace moetrain
