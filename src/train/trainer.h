// The training loop of `moetrain train`: data (token shards, or a synthetic memory
// task with data.synthetic), model, AdamW with a schedule,
// gradient accumulation and clipping, validation and samples every N steps, a
// console line per step and <run>/metrics.jsonl; at the end the model is written
// to <run>/model (Hugging Face layout + the resolved config).
#pragma once

#include <memory>

#include "config/config.h"

namespace moetrain {

struct TrainSummary {
  int64_t steps = 0;
  double last_train_loss = 0;
  double last_val_loss = -1;  // -1: no validation data
  double last_val_acc = -1;   // data.synthetic: answer accuracy of the last evaluation; -1 otherwise
  double tokens_per_second = 0;
};

TrainSummary train(const Config& config);

}  // namespace moetrain
