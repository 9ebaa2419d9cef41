// Gradient synchronisation for data parallelism (and for the expert-data-
// parallel group): sums the parameters' gradients over a group in flattened
// buckets, then scales them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace moetrain::comm {

// A tensor whose grad is summed, and the name errors give it (the trainer passes
// the model's parameters; comm/ knows tensors, not nn's parameter lists).
struct GradTensor {
  std::string name;
  Tensor tensor;  // a leaf; its grad is what gets summed
};
using GradTensors = std::vector<GradTensor>;

struct GradSyncOptions {
  double scale = 1.0;                       // applied to the sums; 1 / group size gives the mean
  int64_t bucket_bytes = int64_t{32} << 20; // the most bytes one all_reduce carries (a larger grad goes alone)
};

struct GradSyncStats {
  int num_buckets = 0;  // all_reduce calls on gradient buckets
  int64_t bytes = 0;    // bytes reduced (buffer bytes, summed over buckets)
  int num_started_early = 0;  // GradReducer: buckets whose sum started during backward, before finish()
};

// grad = scale * (sum over the group of grad) for every parameter, on every rank
// of the group; every rank must pass the same list (names, shapes, dtypes, order).
//
// A parameter without a grad on some ranks counts as zeros there, and gets the
// sum; one without a grad on every rank stays without (the optimizer skips it,
// as with one process). To agree on that, the ranks first sum one flag per
// parameter (one small all_reduce). Buckets: per dtype (f32, then f64), the
// grads in list order are copied into a buffer until the next would exceed
// bucket_bytes; one all_reduce_sum per buffer. bf16 grads are summed in f32
// buckets and rounded back once. Grads have the parameter's dtype and device; CUDA
// grads are packed on the device and summed through NCCL. GradReducer below does
// the same sums while backward runs.
GradSyncStats all_reduce_grads(Communicator& comm, const GradTensors& params, const GradSyncOptions& options = {});

// The distributed optimizer's layout of one group's parameters (train.zero 1,
// docs/parallelism.md "Distributed optimizer"): their elements, parameter after
// parameter in list order, form one flat sequence, cut into one contiguous range
// per rank of the group: rank r owns [bounds[r], bounds[r + 1]), bounds[r] =
// floor(total * r / size). Element ranges rather than whole parameters: the
// ranks hold within one element of the same count, whatever the largest tensor.
struct FlatShards {
  std::vector<int64_t> offsets;  // [parameters + 1]: where each starts in the flat sequence
  std::vector<int64_t> bounds;   // [size + 1]
  int size() const { return static_cast<int>(bounds.size()) - 1; }
  // The elements [begin, end) of parameter i (its own flat indices) that `rank` owns.
  std::pair<int64_t, int64_t> owned(size_t i, int rank) const;
};
FlatShards make_flat_shards(const std::vector<int64_t>& numels, int size);
// The same sequence cut at whole units, balanced by cost (train.zero 1 under
// train.optimizer muon): parameter i may be cut only at multiples of units[i]
// elements from its start (1: anywhere, as above; its numel: never; A·B for a
// batch of E matrices [E, A, B]: between matrices), and costs[i] (> 0; spread
// evenly over its elements) is what each rank's share balances: rank r's range
// ends at the allowed cut nearest to the point where the cost before it reaches
// total_cost · (r + 1) / size (ties: the earlier cut). Ranks may own nothing when
// a unit is larger than a share.
FlatShards make_flat_shards(const std::vector<int64_t>& numels, int size, const std::vector<int64_t>& units,
                            const std::vector<double>& costs);

// The gradient sums of train.zero 1: like all_reduce_grads (the same "has a grad"
// flags, bf16 in f32, scale applied in the bucket dtype), but each rank receives
// only the elements it owns (Communicator::reduce_scatter_sum_v per bucket) and
// writes scale * sum there; the rest of its grads keep its own, unsummed values.
// A bucket is a run of at most bucket_bytes of the flat sequence of one bucket
// dtype (a parameter may span buckets). With two ranks the sums are those of
// all_reduce_grads bit for bit (a + b); with more, MPI may add in another order.
GradSyncStats reduce_scatter_grads(Communicator& comm, const GradTensors& params, const FlatShards& shards,
                                   const GradSyncOptions& options = {});
// After each rank updated the elements it owns: every rank gets every element
// (Communicator::all_gather_v per bucket of at most bucket_bytes, per dtype).
void all_gather_params(Communicator& comm, const std::vector<Tensor>& params, const FlatShards& shards,
                       int64_t bucket_bytes);
// One tensor's owned parts (flat, this rank's `own`) concatenated in rank order:
// [sum of the ranks' counts]. Two collectives (the counts, then the parts).
Tensor all_gather_owned(Communicator& comm, const Tensor& own);

// The same sums, overlapped with backward (train.overlap_grad_sync), in the
// manner of DDP's gradient buckets. Buckets are made once, walking the
// parameters in reverse list order (the order backward finishes them): one
// open bucket per (communicator, bucket dtype), closed when the next grad would
// exceed bucket_bytes. Each step:
//   begin();  install grad_ready as the autograd grad-ready hook
//   (autograd/engine.h) for the last backward;  finish().
// A bucket whose grads are all ready is packed and its sum started
// (Communicator::start_all_reduce_sum), but only after every earlier bucket
// started: every rank starts them in the same order, whatever order its own
// grads become ready in. finish() starts the rest (a parameter not reached by
// this rank's backward counts as zeros, as above), waits for every sum, and
// writes scale * sum into the grads. With each bucket a CPU i32 flag per member
// (1 where the rank has a grad) is summed too, so a parameter without a grad on
// every rank stays without, as with all_reduce_grads, at no extra round trip.
// A parameter this rank's backward does not reach holds back its bucket and all
// later ones until finish(): keep such parameters (if known) early in the list.
// The sums equal all_reduce_grads' bit for bit wherever MPI's summation order
// over ranks does not depend on the message size (always with two ranks).
struct ReducedParameter {
  GradTensor param;
  Communicator* comm = nullptr;  // the group its grad is summed over
};

class GradReducer {
 public:
  // Checks the list as all_reduce_grads does (defined, listed once, one device,
  // f32/bf16/f64) and lays out the buckets.
  explicit GradReducer(std::vector<ReducedParameter> params, const GradSyncOptions& options = {});
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Starts a step (the grads of the coming backward are to be summed).
  void begin();
  // A leaf's grad is final: the grad-ready hook. Leaves that are not in the list are ignored.
  void grad_ready(const Tensor& leaf);
  // Starts what backward left, waits for all sums and writes the grads; ends the step.
  GradSyncStats finish();
  bool in_step() const { return in_step_; }
  // Buckets in start order: the indices into the constructor's list of their members.
  std::vector<std::vector<size_t>> bucket_members() const;

 private:
  struct Bucket;
  void start_ready_buckets();
  void start(Bucket& b);

  std::vector<ReducedParameter> params_;
  GradSyncOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<size_t> bucket_of_;  // per parameter
  std::unordered_map<const TensorImpl*, size_t> index_;
  std::vector<bool> ready_;
  size_t next_to_start_ = 0;
  bool in_step_ = false;
  bool groups_ready_ = false;  // the groups' NCCL communicators exist (CUDA)
};

}  // namespace moetrain::comm
