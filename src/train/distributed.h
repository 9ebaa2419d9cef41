// Data, expert and pipeline parallel training: the process grid of this run and
// the collectives the trainer issues around the model (docs/parallelism.md).
//
// world = pp x dp x ep ranks (train.pp, train.ep; dp = world / (pp x ep)). A
// stage's dp x ep ranks are its data-parallel replicas: replica q (the rank's
// index in its stage) takes batches q, q + replicas, ... of the shared stream
// (every stage of a pipeline reads the same ones), so the replicas equal one rank
// with replicas x the gradient accumulation. Experts are sharded over the ep
// group; replicated parameters get their gradient summed over the stage (the
// world at pp = 1), expert shards over their dp group, both divided by the
// number of replicas (each replica's loss is the mean over its own tokens); with
// tied embeddings and pp > 1 the table's gradient is then summed between the
// first and the last stage, which both hold it.
#pragma once

#include <memory>
#include <string>

#include "autograd/engine.h"
#include "comm/distributed.h"
#include "config/config.h"
#include "nn/language_model.h"
#include "nn/moe.h"
#include "optim/make_optimizer.h"

namespace moetrain {

class HybridModel;

// This rank's slice of the experts (its ep index and the ep size).
inline ExpertShard expert_shard(const Distributed& d) { return {d.grid.ep_index, d.grid.ep}; }

// The run's parallel dimensions from the config (train.pp, train.ep, train.tp,
// train.cp) over `world` ranks: comm::make_parallel_dims, its refusals a ConfigError
// naming the key with where it was set (exit 2).
comm::ParallelDims parallel_dims(const Config& config, int world);

// The world (MPI under mpirun, else one process) split by train.ep; errors name
// the key (ep must divide the world size and model.moe.num_experts; the model
// family's capabilities, nn/model_family.h check_capabilities, before anything else). Starts the
// collective watchdog (comm/watchdog.h) when dist.timeout_s > 0 and there are
// several ranks. The collectives below label their waits for its message.
Distributed make_distributed(const Config& config);

// The group a replicated (non-expert) parameter's gradient is summed over: the
// stage's ranks (the world at pp = 1).
comm::Communicator& replica_group(Distributed& d);
// The ranks that hold replicas of parameter p, over which its gradient is summed
// and (train.zero 1) its optimizer state sharded: the expert-data-parallel group
// for routed-expert shards (ep > 1), the stage's ranks for everything else
// (replica_group(d) above: the world at pp = 1). Gradient sync, clipping and the
// sharded optimizer all ask here.
comm::Communicator* replica_group(const Distributed& d, const NamedParameter& p);

// train.zero 1: groups the parameters by replica group, splits each group's
// elements over its ranks (comm::FlatShards) into d.zero_groups, and returns the
// elements of each parameter this rank owns (the optimizer's shard). AdamW's
// parameters are cut anywhere (equal element counts); under train.optimizer muon
// the Muon parameters only between whole matrices and the shares are balanced by
// update_cost (optim/make_optimizer.h). Not collective.
std::vector<ElementRange> make_zero_shards(Distributed& d, const ParameterList& params,
                                           const OptimizerOptions& options = {});

// Prints (root) one line per rank: rank, host, pp/dp/ep index, threads. Collective.
void log_rank_table(Distributed& d, int threads);

// Gradient sums as described above (bucketed all-reduces). After
// begin_overlapped_grad_sync it finishes the sums started during backward.
// train.zero 1 (not overlapped): reduce-scatters instead, each rank receiving the
// sums of the elements it owns (comm::reduce_scatter_grads); its other grad
// elements are left unsummed, and only the owned ones are read afterwards.
void sync_gradients(Distributed& d, const LanguageModel& model);
// train.overlap_grad_sync with several ranks: call before the backward of the
// step's last micro-batch and keep the returned guard alive through it, so the
// buckets of grads backward has finished are summed while it goes on
// (comm::GradReducer). Null (nothing to do) with one rank or the key off. Every
// rank must take the same decision.
std::unique_ptr<autograd::GradReadyHookGuard> begin_overlapped_grad_sync(Distributed& d, const LanguageModel& model);
// The global gradient norm (expert shards summed over their ep group); clips every
// rank's grads by the same factor. Returns the norm before clipping. train.zero 1:
// the squares of each replica group's owned elements are folded rank after rank
// (each continues the running sum of the previous rank, passed on by a broadcast),
// which is the fold over the whole list that zero 0 does: the same norm bit for
// bit on the CPU; only owned elements are scaled.
double clip_grad_norm(Distributed& d, const LanguageModel& model, double max_norm);
// train.zero 1, after the optimizer updated the owned elements: all-gathers them
// so every replica holds every updated parameter. Collective.
void gather_parameters(Distributed& d, const LanguageModel& model);
// Sums the MoE layers' assignment counts over the world (before the bias update),
// so every rank moves its router biases identically.
void all_reduce_moe_stats(Distributed& d, LanguageModel& model);
// Mean of a per-rank value over the world.
double mean_over_world(Distributed& d, double value);
// The step's loss: the mean over the replicas of the last stage's losses (each
// rank's at pp = 1); `value` is ignored on the other stages. Collective.
double mean_loss(Distributed& d, double value);
// train.zero 1 with mixed precision: bf16 parameter i's f32 master at full size
// (its owned parts all-gathered over the replica group, every rank taking part);
// otherwise opt.master_or_parameter(i). Collective over the replica group when
// gathering.
Tensor full_master(Distributed& d, const LanguageModel& model, const Optimizer& opt, size_t i);
// Parameters and buffers at full size (expert shards gathered over the ep group;
// with pp > 1 every stage's sent to the root), to save on the root; with `opt`, a
// bf16 parameter's f32 master copy stands for it (mixed precision). Collective;
// complete on the root only when pp > 1.
ParameterList full_state(Distributed& d, const LanguageModel& model, const Optimizer* opt = nullptr);

}  // namespace moetrain
