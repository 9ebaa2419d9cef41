#include "nn/language_model.h"

#include "core/grad_mode.h"
#include "core/graph_capture.h"
#include "core/profile.h"
#include "nn/hf_adapter.h"
#include "ops/elementwise/elementwise.h"
#include "ops/softmax/softmax.h"

namespace moetrain {

Tensor LanguageModel::loss(const Tensor& ids, const Tensor& targets, bool training) {
  Tensor logits = forward_padded(ids, training);  // [B, T, padded_vocab_size()]
  profile::Region region("embedding/head");
  // Targets follow the logits (the trainer moves both; eval passes host batches).
  // Mixed precision: cross_entropy reads bf16 logits as they are and gives an
  // f32 loss (the logged loss keeps more than bf16's 3 digits) and a bf16
  // gradient, with no f32 copy of the [B*T, V] logits (docs/cuda.md#mixed-precision).
  // Host targets are range-checked here, before they move: on CUDA the op does not
  // read them back (docs/cuda.md#cross-entropy-on-bf16-logits).
  if (logits.is_cuda() && !targets.is_cuda())
    check_cross_entropy_targets(targets, vocab_size(), -100, padded_vocab_size() - vocab_size());
  return cross_entropy(logits, targets.to(logits.device()), -100, Reduction::mean, vocab_size());
}

StageOutput LanguageModel::stage_forward(const Tensor& ids, const Tensors& inputs, const Tensor& targets,
                                         bool training, int64_t chunk) {
  MT_CHECK(chunk == 0, "{} model: chunk {} of a model without virtual stages", arch(), chunk);
  MT_CHECK(pipeline_stage().whole(), "{} model: a pipeline stage needs the model's own stage_forward", arch());
  MT_CHECK(inputs.empty(), "{} model: the whole model receives no activations, got {}", arch(), inputs.size());
  StageOutput out;
  if (targets.defined()) out.loss = loss(ids, targets, training);
  else out.logits = forward(ids, training);
  return out;
}

std::unique_ptr<HfAdapter> LanguageModel::hf_adapter() const { return nullptr; }

// A model without softmax attention (or one that does not record) has no site.
void LanguageModel::set_track_max_logits(bool) {}
std::vector<QkClipSite*> LanguageModel::qk_clip_sites() { return {}; }

void LanguageModel::reset_max_logits() {
  for (QkClipSite* site : qk_clip_sites()) site->max_logit = Tensor();
}

bool wants_max_logit(const QkClipSite* site) { return site && autograd::grad_enabled(); }

void fold_max_logit(QkClipSite& site, const Tensor& max_logit) {
  MT_ASSERT(max_logit.shape() == Shape{site.n_head}, "layer {}: max_logit is {}, the site has {} heads", site.layer,
            max_logit.shape(), site.n_head);
  site.max_logit = site.max_logit.defined() ? maximum(site.max_logit, max_logit) : max_logit;
  // A CUDA graph's replay writes the same maximum; the host handle to it is set again.
  graph::after_replay([s = &site, m = site.max_logit] { s->max_logit = m; });
}

}  // namespace moetrain
