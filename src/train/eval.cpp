#include "train/eval.h"

#include <algorithm>

#include "core/grad_mode.h"
#include "ops/softmax/softmax.h"

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

AnswerScore evaluate_answers(LanguageModel& model, const data::SyntheticOptions& options, int64_t batch_size,
                             int64_t batches, uint64_t seed) {
  NoGradGuard no_grad;
  Generator gen(seed);
  AnswerScore score;
  double loss_sum = 0;
  int64_t hits = 0;
  for (int64_t i = 0; i < batches; ++i) {
    data::SyntheticBatch batch = data::synthetic_batch(options, batch_size, gen);
    Tensor logits = model.forward(batch.inputs, false);  // [B, T, V]
    const int64_t V = logits.size(2);
    const Tensor lf = logits.to(kCpu).to(DType::f64);
    const double* l = lf.data<double>();
    const int32_t* target = batch.targets.data<int32_t>();
    int64_t answers = 0;
    for (int64_t p = 0; p < batch.targets.numel(); ++p) {
      if (target[p] == data::kIgnoreIndex) continue;
      ++answers;
      const double* row = l + p * V;
      hits += std::max_element(row, row + V) - row == target[p];  // first maximum on ties
    }
    // bf16 logits give an f32 loss (cross_entropy's dtype contract).
    loss_sum += cross_entropy(logits, batch.targets.to(logits.device()), data::kIgnoreIndex).item<double>() *
                static_cast<double>(answers);
    score.answers += answers;
  }
  if (score.answers > 0) {
    score.loss = loss_sum / static_cast<double>(score.answers);
    score.accuracy = static_cast<double>(hits) / static_cast<double>(score.answers);
  }
  return score;
}

}  // namespace moetrain
