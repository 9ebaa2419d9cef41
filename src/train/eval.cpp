#include "train/eval.h"

#include "autograd/grad_mode.h"
#include "ops/softmax.h"

namespace moetrain {

double evaluate(LanguageModel& model, data::DataLoader& loader, int64_t max_batches) {
  NoGradGuard no_grad;
  int64_t per_epoch = loader.num_windows_per_rank() / loader.options().batch_size;
  MT_CHECK(per_epoch > 0, "evaluation data ({}) holds {} windows of {} tokens, fewer than one batch of {}",
           loader.files().empty() ? std::string("?") : loader.files().front(), loader.num_windows(),
           loader.options().seq_len + 1, loader.options().batch_size);
  int64_t batches = max_batches > 0 ? std::min(max_batches, per_epoch) : per_epoch;
  double total = 0;
  for (int64_t b = 0; b < batches; ++b) {
    data::Batch batch = loader.next();
    total += model.loss(batch.inputs, batch.targets, false).item<double>();
  }
  return total / static_cast<double>(batches);  // equal-sized batches: the per-token mean
}

}  // namespace moetrain
