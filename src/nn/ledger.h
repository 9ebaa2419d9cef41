// The parameter / FLOP / memory ledger of a model config (`moetrain ledger`), and
// the cluster planner built on it (`moetrain ledger --plan N`).
// Counts come from the model's own construction code run on shapes only
// (ParamFactory without allocation), so any size is counted in a second.
// A layout is pp x dp x ep ranks, rank = pp_index (dp ep) + dp_index ep + ep_index
// (docs/parallelism.md#the-ledger-flags): the stages split the layers as
// nn/pipeline_stages.h does, the dp x ep ranks of a stage are replicas of its
// non-expert parameters, the routed experts are sharded over ep and replicated over dp.
// Memory is per rank (the worst stage); times are estimates under ClusterAssumptions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moetrain {

class Config;

struct LedgerLayout {
  int64_t dp = 1;    // data-parallel replicas (of each pipeline stage)
  int64_t ep = 1;    // expert-parallel ranks (routed experts sharded over them)
  int64_t pp = 1;    // pipeline stages
  int64_t zero = 0;  // 1: AdamW moments (and bf16 runs' f32 master) sharded over each parameter's replicas
  int64_t micro_batch = 0;    // sequences per micro-batch; 0: train.batch_size
  int64_t num_micro_batches = 0;  // per optimizer step and pipeline (the 1F1B schedule's M); 0: train.grad_accum
  int64_t virtual_stages = 0;     // chunks per pipeline rank (interleaved 1F1B); 0: train.pp_virtual (1 at pp 1)
  int64_t ranks() const { return pp * dp * ep; }
};

// What per-rank memory is held against and what the step-time estimate assumes
// (docs/parallelism.md#the-ledger-flags). Defaults: an H200 node of 8 GPUs.
struct ClusterAssumptions {
  double gpu_memory = 140.0 * 1073741824.0;  // bytes per device (an H200: 141 GB sold, ~140 GiB usable by CUDA)
  double reserve = 10.0 * 1073741824.0;      // CUDA context, NCCL buffers, allocator fragmentation
  double peak_flops = 989e12;                // per device: dense bf16 tensor-core peak of an H200
  double mfu = 0.4;                          // fraction of the peak the layers' compute reaches
  double intra_bandwidth = 450e9;            // bytes/s per device to a device of the same node (NVLink)
  double inter_bandwidth = 50e9;             // bytes/s per device to other nodes (one 400 Gb/s NIC per GPU)
  int64_t devices_per_node = 8;
  double usable() const { return gpu_memory - reserve; }
};

// One pipeline stage, as seen by each of its dp x ep ranks (with virtual stages:
// one pipeline rank's position, holding its V chunks).
struct StageLedger {
  int64_t first_layer = 0, end_layer = 0;     // layers [first, end) (of the first chunk with virtual stages)
  std::vector<std::pair<int64_t, int64_t>> chunks;  // every chunk's layers [first, end), in chunk order
  std::map<std::string, int64_t> components;  // parameters per component on one rank (experts: its shard)
  int64_t params = 0;                         // on one rank
  int64_t expert_params = 0;                  // of those, the rank's shard of the routed experts
  int64_t num_moe_layers = 0;
  double weight_grad_bytes = 0;  // weights and gradients (never sharded)
  double optimizer_bytes = 0;    // AdamW moments and the f32 master (bf16 runs); / replicas with zero 1
  double activation_bytes_per_micro_batch = 0;  // one micro-batch through all the stage's chunks
  // 1F1B: min(pp - stage, M); interleaved: the most (micro-batch, chunk) pairs alive
  // (nn/pipeline_schedule.h), e.g. 2 (pp - 1) + (V - 1) pp + 1 on stage 0.
  int64_t num_micro_batches_in_flight = 0;
  double in_flight_bytes = 0;           // their stored activations at the peak
  double activation_bytes = 0;          // the peak of this stage (with recompute: + the layer being recomputed)
  std::string layers_text() const;      // "3-5" or, with virtual stages, "0-1, 6-7"
  // Gradient sync with several replicas: the bucket being summed and the MPI
  // reduction's own copy of it, 2 x min(train.grad_bucket_mb, the largest replica
  // group's gradient bytes); measured to add to the peak (docs/performance.md#activation-recomputation).
  double grad_sync_bytes = 0;
  // bf16 on the CPU (train.device cpu, train.dtype bf16): the f32 tensors the model's
  // largest-holding bf16 op keeps while it runs (its f32 product before rounding, or
  // f32 copies where a kernel widens; LedgerShapes::cpu_widened), one micro-batch
  // (Ledger::cpu_widen_op). 0 otherwise.
  double cpu_widen_bytes = 0;
  double total_bytes() const {
    return weight_grad_bytes + optimizer_bytes + activation_bytes + grad_sync_bytes + cpu_widen_bytes;
  }
  // Seconds: per micro-batch (forward + backward), and per step for the gradient sync.
  double compute_s = 0, all_to_all_s = 0, p2p_s = 0, grad_sync_s = 0;
  double micro_batch_s() const { return compute_s + all_to_all_s + p2p_s; }
};

struct StepEstimate {
  double bubble = 0;           // (pp - 1) / (V M + pp - 1)
  double pipeline_s = 0;       // (M + (pp - 1) / V) x the slowest stage's micro-batch (all its chunks)
  double grad_sync_s = 0;      // the slowest stage's gradient sync (after the last backward)
  double step_s = 0;           // pipeline_s + grad_sync_s
  int64_t sequences_per_step = 0;  // M x micro_batch x dp x ep
  double tokens_per_second = 0;
  double mfu = 0;  // model FLOPs of the step / (ranks x peak x step_s)
};

struct Ledger {
  std::string arch, description;
  std::map<std::string, int64_t> components;  // parameters per component (group)
  int64_t total = 0;
  int64_t active = 0;  // per token: routed experts at top_k / num_experts, no input embedding table (unless tied)
  double flops_per_token = 0;  // training (forward + backward) at seq_len
  int64_t seq_len = 0, batch_size = 0;  // batch_size: sequences per micro-batch (the layout's micro_batch)
  std::string dtype;                    // train.dtype
  bool recompute = false;               // train.activation_checkpointing
  std::string recompute_modules;        // train.recompute_modules (hybrid)
  // "layers recomputed in backward", "act, experts recomputed in backward", both, or "no recompute".
  std::string recompute_text() const;
  LedgerLayout layout;                  // micro_batch and num_micro_batches resolved
  ClusterAssumptions cluster;
  // Per rank, of the stage with the largest total (the only stage at pp 1):
  int64_t params_per_rank = 0;           // replicated parameters + this rank's expert shard
  double state_bytes_per_rank = 0;       // weights + gradients + optimizer state
  double grad_sync_bytes_per_rank = 0;   // the gradient buckets in flight (StageLedger::grad_sync_bytes)
  double activation_bytes_per_rank = 0;  // the micro-batches in flight (one at pp 1)
  double cpu_widen_bytes_per_rank = 0;   // StageLedger::cpu_widen_bytes
  // The op those bytes are for, "the MLP's f32 product (...): 4 x 768 f32 values per
  // token"; empty when nothing is counted (not bf16 on the CPU, or no such op).
  std::string cpu_widen_op;
  double bytes_per_rank = 0;             // state + activations
  int64_t worst_stage = 0;
  bool fits = false;  // bytes_per_rank <= cluster.usable()
  std::vector<StageLedger> stages;
  StepEstimate step;
  // Decoding cache of one sequence at lengths 1k, 8k and 64k (the model's dtype):
  // KV caches grow with the length, recurrent states do not.
  std::map<int64_t, int64_t> decode_cache_bytes;
};

// Throws ConfigError (naming the key) or Error (naming the flag) when the layout
// does not fit the config.
Ledger make_ledger(const Config& config, LedgerLayout layout, const ClusterAssumptions& cluster = {});
std::string ledger_text(const Ledger& ledger);
std::string ledger_json(const Ledger& ledger);

// `--plan N`: every layout of N devices (pp dividing N up to n_layer, ep dividing
// N / pp and num_experts, dp the rest, zero 0 and 1, virtual stages V = 1 .. 8
// with pp V <= n_layer and M a multiple of pp when V > 1) whose micro-batch count
// M = global_batch / (micro_batch x dp x ep) is a whole number; the feasible ones
// sorted by estimated step time.
struct PlanOptions {
  int64_t devices = 0;
  int64_t global_batch = 0;  // sequences per optimizer step; 0: devices x train.batch_size x train.grad_accum
  int64_t micro_batch = 0;   // sequences per micro-batch; 0: train.batch_size
  int64_t top = 10;          // layouts printed
};

struct Plan {
  PlanOptions options;  // resolved
  int64_t searched = 0;            // layouts evaluated
  std::vector<Ledger> feasible;    // fastest first
  std::vector<Ledger> closest;     // when none is feasible: the smallest per-rank totals
};

Plan plan_layouts(const Config& config, PlanOptions options, const ClusterAssumptions& cluster = {});
std::string plan_text(const Plan& plan);
std::string plan_json(const Plan& plan);

}  // namespace moetrain
