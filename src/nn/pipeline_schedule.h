// The order in which the ranks of a pipeline run their micro-batches
// (docs/parallelism.md#interleaved-virtual-stages): one optimizer step's M
// micro-batches through pp ranks holding V model chunks each (train.pp_virtual),
// pp x V virtual stages, chunk c of rank r being virtual stage c pp + r. V = 1 is
// the plain 1F1B schedule.
//
// Two layers: each rank's own order of forwards and backwards (pipeline_actions),
// and a timeline of all ranks in lock-step ticks (pipeline_timeline) that says at
// which tick each of those runs and which messages cross after it, so that a
// rank's sends and receives are posted in the same tick as its peers' (no
// ordering deadlock whatever the order is) and the schedule's idle ticks are its
// bubble. The trainer runs the timeline (train/pipeline.cpp); the ledger reads
// the micro-batches in flight from the same actions (nn/ledger.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace moetrain {

struct PipelineAction {
  enum class Kind { forward, backward };
  Kind kind = Kind::forward;
  int64_t micro = 0;  // micro-batch
  int64_t chunk = 0;  // this rank's chunk (virtual stage chunk pp + rank)
  bool operator==(const PipelineAction&) const = default;
};

// Rank `rank`'s actions for pp ranks, V chunks each and M micro-batches. V = 1:
// min(pp - rank - 1, M) forwards, then one forward and one backward alternately,
// then the remaining backwards. V > 1 (Megatron-LM's interleaved 1F1B): the
// forwards go over the chunks in groups of pp micro-batches (micro-batches
// 0..pp-1 through chunk 0, then the same through chunk 1, ..., then pp..2pp-1),
// the backwards likewise from the last chunk down; (pp - rank - 1) 2 + (V - 1) pp
// forwards first (at most M V), then alternating. V > 1 needs M a multiple of pp.
std::vector<PipelineAction> pipeline_actions(int64_t pp, int64_t V, int64_t M, int64_t rank);

// The most (micro-batch, chunk) pairs whose activations a rank holds at once
// under `actions` (a forward adds one, its backward frees it).
int64_t pipeline_max_in_flight(const std::vector<PipelineAction>& actions);
// The same, each pair weighted by its chunk's bytes (chunk_bytes[c]): the
// activation memory's peak.
double pipeline_peak_in_flight(const std::vector<PipelineAction>& actions, const std::vector<double>& chunk_bytes);

// One message of the timeline: a forward's output to the next virtual stage, or
// a backward's input gradient to the previous one.
struct PipelineMessage {
  bool gradient = false;
  int64_t micro = 0;
  int64_t chunk = 0;  // the receiving rank's chunk that consumes it
  int peer = 0;       // the other rank (sender for a receive, receiver for a send)
};

// One tick of one rank: at most one action, then the messages of the tick (the
// sends its action made, the receives of what its peers' actions of the same
// tick made), all posted together (at most one per peer and direction).
struct PipelineTick {
  bool has_action = false;
  PipelineAction action;
  std::vector<PipelineMessage> sends, recvs;
};

struct PipelineTimeline {
  int64_t ticks = 0;                              // until the last rank's last action
  std::vector<std::vector<PipelineTick>> ranks;   // per rank, its ticks 0 .. ticks - 1
  // Idle ticks over all ranks' ticks, with a forward taking one tick and a backward
  // `backward_cost` ticks (a backward occupies its rank that long; its messages
  // leave at its end): the modelled bubble fraction.
  double bubble = 0;
};

// Every rank's actions run as early as their inputs allow, a message made in tick t
// usable from tick t + 1. Each rank can compute the whole timeline (it depends on
// pp, V and M only). backward_cost: 1 for the executor (its ticks are steps of
// the order, not time); 2 models a backward as twice a forward for the bubble.
PipelineTimeline pipeline_timeline(int64_t pp, int64_t V, int64_t M, int64_t backward_cost = 1);

// The bubble of the analytic model, (pp - 1) / (V M + pp - 1): the fraction of a
// step a rank idles when every forward and backward takes the same time per chunk.
double pipeline_bubble_model(int64_t pp, int64_t V, int64_t M);

}  // namespace moetrain
