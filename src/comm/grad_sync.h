// Gradient synchronisation for data parallelism (and for the expert-data-
// parallel group): sums the parameters' gradients over a group in flattened
// buckets, then scales them.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "nn/parameters.h"

namespace moetrain::comm {

struct GradSyncOptions {
  double scale = 1.0;                       // applied to the sums; 1 / group size gives the mean
  int64_t bucket_bytes = int64_t{32} << 20; // the most bytes one all_reduce carries (a larger grad goes alone)
};

struct GradSyncStats {
  int num_buckets = 0;  // all_reduce calls on gradient buckets
  int64_t bytes = 0;    // bytes reduced (buffer bytes, summed over buckets)
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
// grads are packed on the device and summed through NCCL (no overlap with backward yet).
GradSyncStats all_reduce_grads(Communicator& comm, const ParameterList& params, const GradSyncOptions& options = {});

}  // namespace moetrain::comm
