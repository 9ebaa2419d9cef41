// Pipeline parallelism (train.pp, docs/parallelism.md#pipeline-parallelism): the
// 1F1B schedule of one training step over the stages of a pipeline, and a whole-
// model view of a stage for evaluation and samples.
//
// Each rank holds one stage (a HybridModel built for it, nn/pipeline_stages.h),
// or V of them with virtual stages, and talks to the ranks of its pipeline
// (ProcessGrid::pipe_group: the same index in the neighbouring stages; with
// virtual stages the last rank's chunk c feeds the first rank's chunk c + 1) with
// Communicator::send_recv. What crosses a
// boundary is the stage's state: with Block AttnRes the completed block sums and
// the open block's running sum (so a block list that spans stages travels with
// the activations, and its gradient comes back), else the residual stream; all
// [B, T, D] in the model's dtype.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "comm/distributed.h"
#include "core/device.h"
#include "data/loader.h"
#include "nn/language_model.h"

namespace moetrain {

struct PipelineStepResult {
  double loss_sum = 0;  // the last stage: the micro-batches' losses (cross-entropy + aux), summed; 0 elsewhere
  int64_t max_in_flight = 0;  // the most micro-batches whose activations this stage held at once
};

// Forward and backward of one optimizer step's micro-batches through the
// pipeline, in the order of nn/pipeline_schedule.h: with one chunk per rank the
// non-interleaved 1F1B (stage s runs min(pp - s - 1, M) forwards first, then
// alternates, keeping at most pp - s micro-batches of activations); with V chunks
// (train.pp_virtual) the interleaved 1F1B over the pp x V virtual stages, whose
// bubble is V times smaller. The ranks run the schedule's timeline in lock step:
// each tick's sends and receives are posted together by both neighbours, so no
// ordering deadlocks. Every micro-batch's loss is scaled by 1 / M (gradient
// accumulation); the parameters' grads hold this rank's sums, to be reduced over
// the replicas after. Collective over the pipeline (and, inside stages, the MoE
// layers' expert groups). batches: the M micro-batches (inputs on the first stage,
// targets on the last are read; every stage passes the same ones).
// activations: the dtype of what crosses a boundary (train.dtype bf16: bf16, though
// the model reports f32, its parameters converted after it was built); default the model's.
PipelineStepResult pipeline_train_step(Distributed& d, LanguageModel& stage, const std::vector<data::Batch>& batches,
                                       Device device, std::optional<DType> activations = std::nullopt);

// The whole model seen from one stage, for evaluation and samples: forward(ids)
// runs the pipeline with no gradients (every stage of a pipeline must call it
// with the same ids, as the trainer's evaluation and samples do: all ranks read
// the same windows and sample with the same seed) and returns the logits on every
// stage (broadcast from the last). Decoding recomputes the whole prefix at each
// call (no per-stage caches): meant for the short samples of a training log.
std::unique_ptr<LanguageModel> pipelined_model(Distributed& d, LanguageModel& stage,
                                               std::optional<DType> activations = std::nullopt);

}  // namespace moetrain
