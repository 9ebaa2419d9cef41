// Mean next-token cross-entropy of a model over a token shard: consecutive,
// non-overlapping windows of T tokens from the start of the data (window i covers
// tokens iT..iT+T-1; the target of position t is token t+1).
#pragma once

#include "data/loader.h"
#include "nn/language_model.h"

namespace moetrain {

// Averages the loss of up to `max_batches` batches of a sequential loader (all of
// them when max_batches <= 0), weighting every token equally. Restores nothing:
// the loader advances.
double evaluate(LanguageModel& model, data::DataLoader& loader, int64_t max_batches);

}  // namespace moetrain
