// Mean next-token cross-entropy of a model over a token shard: consecutive,
// non-overlapping windows of T tokens from the start of the data (window i covers
// tokens iT..iT+T-1; the target of position t is token t+1).
#pragma once

#include "data/loader.h"
#include "data/synthetic.h"
#include "nn/language_model.h"

namespace moetrain {

// Averages the loss of up to `max_batches` batches of a sequential loader (all of
// them when max_batches <= 0), weighting every token equally. Restores nothing:
// the loader advances.
double evaluate(LanguageModel& model, data::DataLoader& loader, int64_t max_batches);

// A synthetic memory task's held-out score: mean cross-entropy and argmax accuracy
// over the answer positions (target != kIgnoreIndex) of `batches` batches of
// batch_size rows drawn from Generator(seed).
struct AnswerScore {
  double loss = 0;
  double accuracy = 0;
  int64_t answers = 0;
};
AnswerScore evaluate_answers(LanguageModel& model, const data::SyntheticOptions& options, int64_t batch_size,
                             int64_t batches, uint64_t seed);

}  // namespace moetrain
