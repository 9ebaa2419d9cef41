// NcclGroup: the collectives of one Communicator group on CUDA tensors, through
// NCCL. The MPI communicator owns one and hands it every collective whose
// tensor is on a GPU, so callers pass CUDA tensors to the same Communicator
// calls as CPU tensors. No NCCL header here (only nccl.cpp includes nccl.h).
//
// Built from nccl.cpp when MOETRAIN_WITH_CUDA; without CUDA (nccl_disabled.cpp)
// every collective throws, which no caller reaches: no tensor is on a GPU there.
//
// Conventions:
// - One device per group and process: the ncclComm_t is created on the first
//   collective, on that tensor's device, and every later tensor must be on the
//   same device. Creation is collective over the group: rank 0 makes the
//   ncclUniqueId and broadcasts it through the group's host Communicator as a
//   CPU tensor, then every rank calls ncclCommInitRank. So every rank of the
//   group must pass tensors on a GPU to the same collectives (never CPU on one
//   rank and CUDA on another).
// - Every NCCL call runs on cuda::stream(device), the stream of every kernel
//   and copy: collectives are ordered with the kernels around them without
//   events, and return once queued (a later copy to the host waits for them).
// - start_all_reduce_sum is the exception: it records an event on the compute
//   stream, makes the device's communication stream (one per device, shared by
//   every group, so started collectives keep their start order on the GPU too)
//   wait for it, queues the sum there and records a second event; wait() makes
//   the compute stream wait for that one. Kernels queued in between overlap
//   with the sum. The tensor is kept alive by the handle, and the caching
//   allocator can only hand its block out again after wait() (its next users
//   queue on the compute stream, behind the event).
// - Argument checks that need no peers happen before any NCCL call; all_gather
//   checks that the ranks' shapes agree with one small exchange on the host
//   communicator, as the MPI implementation does.
// - Failures throw moetrain::Error naming the NCCL call, NCCL's error text, the
//   rank in the group and the host (MT_NCCL_CHECK in nccl.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace moetrain::comm {

class Communicator;
class PendingCollective;
struct P2POp;

class NcclGroup {
 public:
  // `host` is the group's host (MPI) communicator: it bootstraps the NCCL
  // communicator and must outlive this object.
  explicit NcclGroup(Communicator& host);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  // The Communicator collectives, for CUDA tensors (checked); same meaning.
  // all_reduce_sum and reduce_scatter_sum take f32, f64, bf16, i32 or i64 (bf16
  // is summed by NCCL in bf16); the others move bytes of any dtype.
  void all_reduce_sum(Tensor& t);
  // all_reduce_sum on the device's communication stream (see below); the
  // handle's wait() makes the compute stream wait for it.
  std::unique_ptr<PendingCollective> start_all_reduce_sum(Tensor& t);
  Tensor all_gather(const Tensor& t);
  void broadcast(Tensor& t, int root);
  Tensor all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows);
  Tensor reduce_scatter_sum(const Tensor& t);
  // Communicator::send_recv: every send and receive in one group call.
  void send_recv(std::vector<P2POp>& ops);
  // NCCL has no variable-count collectives: reduce_scatter_sum_v is one
  // ncclReduce per rank with a non-empty count (rooted there), all_gather_v one
  // ncclBroadcast per such rank, each inside one ncclGroupStart/End.
  Tensor reduce_scatter_sum_v(const Tensor& t, const std::vector<int64_t>& counts);
  Tensor all_gather_v(const Tensor& t, const std::vector<int64_t>& counts);

  // The device of the NCCL communicator; -1 before the first collective.
  int device() const;

  struct Impl;  // the ncclComm_t and its device: defined in nccl.cpp only

 private:
  // Checks t (defined, on this group's GPU), creates the NCCL communicator on
  // the first call (collective) and makes its device current.
  Impl& impl_for(const char* op, const Tensor& t);
  // Throws the error of a failed NCCL call (res: an ncclResult_t), via the Impl.
  [[noreturn]] void fail_nccl(int res, const char* call) const;

  Communicator& host_;
  std::unique_ptr<Impl> impl_;  // null until the first collective
};

}  // namespace moetrain::comm
