// train.qk_clip (docs/model.md#qk-clip): after the optimizer step, each softmax-
// attention head's largest logit of the step, MAX-reduced over the head's
// replicas, and the query/key rows of every head above train.qk_clip_tau scaled
// (optim/qk_clip.h) in the optimizer's master copy and in the parameter.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "comm/distributed.h"
#include "nn/language_model.h"
#include "optim/optimizer.h"

namespace moetrain {

struct QkClipSummary {
  bool recorded = false;  // some head of this rank's layers saw a logit this step
  double max_logit = 0;   // the largest of the step over this rank's layers (its stage's under pp)
  int64_t clipped_heads = 0;
  std::vector<std::pair<std::string, double>> layers;  // (site label, its largest logit), this rank's stage
};

// Collective over the replica group of the attention weights (the stage's ranks;
// the world at pp 1). Call after opt.step() and before the train.zero 1 all-gather:
// each rank scales the elements of the weights it owns (its master, then the bf16
// copy rounded from it), and the all-gather takes them to the other replicas.
// Heads at or below tau keep their bits. Resets the sites' statistics for the
// next step.
QkClipSummary apply_qk_clip(Distributed& d, LanguageModel& model, Optimizer& opt, double tau);

}  // namespace moetrain
