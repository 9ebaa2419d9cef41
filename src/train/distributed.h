// Data + expert parallel training (issue 5): the process grid of this run and
// the collectives the trainer issues around the model.
//
// world = dp x ep ranks (train.ep; dp = world / ep). Every rank reads its own
// micro-batches (rank r takes batches r, r + world, ... of the shared stream, so
// dp ranks equal one rank with world x the gradient accumulation); experts are
// sharded over the ep group; replicated parameters get their gradient summed
// over the world, expert shards over their dp group, both divided by the world
// size (each rank's loss is the mean over its own tokens).
#pragma once

#include <memory>
#include <string>

#include "autograd/engine.h"
#include "comm/distributed.h"
#include "config/config.h"
#include "nn/language_model.h"
#include "nn/moe.h"

namespace moetrain {

class AdamW;
class HybridModel;

// This rank's slice of the experts (its ep index and the ep size).
inline ExpertShard expert_shard(const Distributed& d) { return {d.grid.ep_index, d.grid.ep}; }

// The world (MPI under mpirun, else one process) split by train.ep; errors name
// the key (ep must divide the world size and model.moe.num_experts). Starts the
// collective watchdog (comm/watchdog.h) when dist.timeout_s > 0 and there are
// several ranks. The collectives below label their waits for its message.
Distributed make_distributed(const Config& config);

// Prints (root) one line per rank: rank, host, dp/ep index, threads. Collective.
void log_rank_table(Distributed& d, int threads);

// Gradient sums as described above (bucketed all-reduces). After
// begin_overlapped_grad_sync it finishes the sums started during backward.
void sync_gradients(Distributed& d, const LanguageModel& model);
// train.overlap_grad_sync with several ranks: call before the backward of the
// step's last micro-batch and keep the returned guard alive through it, so the
// buckets of grads backward has finished are summed while it goes on
// (comm::GradReducer). Null (nothing to do) with one rank or the key off. Every
// rank must take the same decision.
std::unique_ptr<autograd::GradReadyHookGuard> begin_overlapped_grad_sync(Distributed& d, const LanguageModel& model);
// The global gradient norm (expert shards summed over their ep group); clips every
// rank's grads by the same factor. Returns the norm before clipping.
double clip_grad_norm(Distributed& d, const LanguageModel& model, double max_norm);
// Sums the MoE layers' assignment counts over the world (before the bias update),
// so every rank moves its router biases identically.
void all_reduce_moe_stats(Distributed& d, LanguageModel& model);
// Mean of a per-rank value over the world.
double mean_over_world(Distributed& d, double value);
// Parameters and buffers at full size (expert shards gathered over the ep group),
// to save on the root; with `opt`, a bf16 parameter's f32 master copy stands for
// it (mixed precision). Collective.
ParameterList full_state(Distributed& d, const LanguageModel& model, const AdamW* opt = nullptr);

}  // namespace moetrain
