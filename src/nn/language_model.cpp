#include "nn/language_model.h"

#include "core/profile.h"
#include "nn/hf_adapter.h"
#include "ops/softmax/softmax.h"

namespace moetrain {

Tensor LanguageModel::loss(const Tensor& ids, const Tensor& targets, bool training) {
  Tensor logits = forward(ids, training);
  profile::Region region("embedding/head");
  // Targets follow the logits (the trainer moves both; eval passes host batches).
  // Mixed precision: bf16 logits are widened, so the loss and its gradient's
  // softmax are f32 (the logged loss keeps more than bf16's 3 digits).
  if (logits.dtype() == DType::bf16) logits = logits.to(DType::f32);
  return cross_entropy(logits, targets.to(logits.device()));
}

StageOutput LanguageModel::stage_forward(const Tensor& ids, const Tensors& inputs, const Tensor& targets,
                                         bool training) {
  MT_CHECK(pipeline_stage().whole(), "{} model: a pipeline stage needs the model's own stage_forward", arch());
  MT_CHECK(inputs.empty(), "{} model: the whole model receives no activations, got {}", arch(), inputs.size());
  StageOutput out;
  if (targets.defined()) out.loss = loss(ids, targets, training);
  else out.logits = forward(ids, training);
  return out;
}

std::unique_ptr<HfAdapter> LanguageModel::hf_adapter() const { return nullptr; }

}  // namespace moetrain
