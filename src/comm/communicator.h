// Communicator: one group of ranks and the collectives the trainer needs (data
// parallel gradient sums, expert-parallel all-to-all). Two implementations run
// the same caller code: MPI (src/comm/mpi.cpp, the only file that includes
// mpi.h) and the one-process communicator, whose collectives are copies.
//
// Conventions:
// - Tensors are CPU or CUDA tensors (always contiguous in this project). The
//   MPI communicator moves CPU tensors with MPI and hands CUDA tensors to NCCL
//   (comm/nccl.h: an NCCL communicator per group, created on its first CUDA
//   collective); the one-process communicator copies on the tensor's device.
//   Every rank of a group passes its tensors on the same kind of device.
//   all_to_all_counts and barrier always run on the host.
// - CPU collectives are blocking (but start_all_reduce_sum). CUDA collectives are queued on the device's
//   stream (cuda::stream) behind the kernels that produced their inputs and
//   return at once; whatever reads the result on that stream, or copies it to
//   the host, runs after them.
// - Every rank of the group must call the same collectives in the
//   same order with matching arguments (shapes, dtypes, roots, row counts).
// - Argument errors that one rank can see alone (a wrong number of counts, a
//   dtype) are checked before communicating. What needs the peers' view
//   (recv_rows matching what the peers send, same shapes for broadcast) is left
//   to MPI, which reports truncation as an error; all_gather checks shapes with
//   one extra small exchange.
// - Every MPI failure throws moetrain::Error naming the MPI call, the rank (in
//   the group and in the world), the host and MPI's error text.
// - Sizes: MPI counts are int. Row exchanges (all_gather, all_to_all_v) count
//   rows of a contiguous row datatype, so they reach 2^31-1 rows of any size
//   (beyond: a clear error); all_reduce_sum, reduce_scatter_sum and broadcast
//   are split into chunks of 2^30 elements/bytes and have no limit. NCCL counts
//   are size_t: no limit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moetrain::comm {

// One point-to-point transfer of a send_recv batch (pipeline parallelism).
struct P2POp {
  enum class Kind { send, recv };
  Kind kind = Kind::send;
  int peer = 0;   // rank in this group
  Tensor tensor;  // send: what goes; recv: allocated by the caller (shape, dtype, device), filled in place
};

// A collective started by start_all_reduce_sum and not yet waited for. wait()
// ends it: on the CPU it blocks until the result is in the tensor; on CUDA it
// orders the device's stream after the collective and returns at once (as the
// blocking CUDA collectives do). Destroying a handle that was not waited for
// waits (errors there are logged, not thrown).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait() = 0;
  // Without blocking: lets the library progress the collective (MPI_Testall;
  // MPI moves a started collective on only inside MPI calls) and returns
  // whether it is done. wait() is still needed to end it.
  virtual bool test() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The processor (host) name of this rank.
  virtual std::string host() const = 0;

  // MPI_Comm_split: ranks passing the same color form a group, ordered by key
  // (ties by rank in this group). A negative color (kNoGroup) joins no group
  // and gets nullptr. Collective over this group.
  virtual std::unique_ptr<Communicator> split(int color, int key) const = 0;

  // t = sum of t over the group, in place; f32, f64, i32 or i64, and bf16 on
  // CUDA (NCCL sums bf16 in bf16; on the CPU convert to f32 first).
  virtual void all_reduce_sum(Tensor& t) = 0;
  // all_reduce_sum started without waiting for it, to overlap it with other
  // work: t holds the sum after the handle's wait(). Until then t must not be
  // read or written (the handle keeps its storage alive). CPU: MPI_Iallreduce;
  // CUDA: NCCL on the device's communication stream, after the work queued so
  // far on the compute stream (comm/nccl.h). Collectives started this way count
  // in the order they are started, like blocking ones.
  virtual std::unique_ptr<PendingCollective> start_all_reduce_sum(Tensor& t) = 0;
  // t [size * n, ...] (the same shape on every rank) -> [n, ...]: row block
  // `rank` of the sum of t over the group, i.e. all_reduce_sum followed by
  // taking this rank's n rows, without forming the whole sum. Dtypes as
  // all_reduce_sum.
  virtual Tensor reduce_scatter_sum(const Tensor& t) = 0;
  // The variable-count form (MPI_Reduce_scatter), for flat tensors: t
  // [sum(counts)] (the same on every rank) -> [counts[rank]], elements
  // [sum(counts[0..rank)), + counts[rank]) of the sum over the group. Every rank
  // passes the same counts (one per rank, each < 2^31). Dtypes as all_reduce_sum.
  // The sharded optimizer's gradient sums (train.zero 1, docs/parallelism.md).
  virtual Tensor reduce_scatter_sum_v(const Tensor& t, const std::vector<int64_t>& counts) = 0;
  // [size * n, ...]: the ranks' t ([n, ...], the same shape on every rank,
  // checked) concatenated along dim 0 in rank order. Any dtype.
  virtual Tensor all_gather(const Tensor& t) = 0;
  // The variable-count form (MPI_Allgatherv), for flat tensors: t [counts[rank]]
  // -> [sum(counts)], rank r's t at offset sum(counts[0..r)). Every rank passes
  // the same counts (each < 2^31). Any dtype. Not shape-checked beyond t's own
  // count: the counts say it all.
  virtual Tensor all_gather_v(const Tensor& t, const std::vector<int64_t>& counts) = 0;
  // t = root's t, in place (the same shape and dtype on every rank).
  virtual void broadcast(Tensor& t, int root) = 0;
  // Variable all-to-all of rows (dim 0) of `send` [N, ...], any dtype:
  // rows [sum(send_rows[0..r)), sum(send_rows[0..r])) go to rank r. Returns
  // [sum(recv_rows), ...]: recv_rows[r] rows from rank r, in rank order.
  // recv_rows[r] must equal what rank r sends here (all_to_all_counts gives it).
  virtual Tensor all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows,
                              const std::vector<int64_t>& recv_rows) = 0;
  // One count per peer: returns recv with recv[r] = what rank r passed as
  // send_counts[this rank].
  virtual std::vector<int64_t> all_to_all_counts(const std::vector<int64_t>& send_counts) = 0;
  virtual void barrier() = 0;
  // Point-to-point: the sends and receives of `ops` are started together and all
  // finished on return (CPU: MPI_Isend/MPI_Irecv and one MPI_Waitall; CUDA: one
  // NCCL group call on the device's stream), so a pipeline stage can send to one
  // neighbour while it receives from the other, or from the same one, without an
  // ordering deadlock. Messages between two ranks arrive in the order they were
  // posted; a receive must match its send's bytes exactly (MPI reports
  // truncation as an error; a shorter message is caught here). Tensors must be
  // contiguous; all of one call on the same kind of device. The one-process
  // communicator pairs the k-th send to itself with its k-th receive (a copy).
  virtual void send_recv(std::vector<P2POp>& ops) = 0;
  // send_recv started and not finished: the ops are posted now and the handle's
  // wait() ends them (receives filled; the handle keeps every tensor alive until
  // then), so a pipeline rank goes on computing while its messages travel and
  // waits only for a receive it is about to use. Messages between two ranks still
  // match in posting order. CPU under MPI: MPI_Isend/MPI_Irecv; elsewhere (CUDA:
  // NCCL's group is queued on the stream anyway; one process) send_recv runs at
  // once and the handle is already done.
  virtual std::unique_ptr<PendingCollective> start_send_recv(std::vector<P2POp> ops);
};

inline constexpr int kNoGroup = -1;  // split() color of a rank that joins no group

// A group of one (this process): collectives are copies, split gives another.
std::unique_ptr<Communicator> single_process();

// True when this process was started by an MPI launcher (mpirun, mpiexec, srun
// with PMI/PMIx): OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK is set.
bool launched_with_mpi();

// The world: MPI_COMM_WORLD (a duplicate, with MPI_ERRORS_RETURN) when MPI is
// used, else single_process(). MPI is used when launched_with_mpi(), or when
// the environment variable MOETRAIN_MPI is 1 (force; a singleton MPI run) or 0
// (never). The first call initialises MPI (MPI_Init_thread, FUNNELED: only the
// main thread calls MPI; OpenMP threads never do); MPI_Finalize runs at exit.
Communicator& world();

// Whether MPI has been initialised (by world()) and not yet finalised.
bool mpi_active();

// Ends the job with `exit_code` on an error path. Under MPI this is MPI_Abort,
// which stops every rank: a normal exit would run
// MPI_Finalize, which waits for peers that may be blocked in a collective
// waiting for this rank. Without MPI: std::exit.
[[noreturn]] void abort_job(int exit_code);

namespace detail {
// Argument checks shared by the implementations (they need no peers).
void check_defined(const char* op, const Tensor& t);
// f32, f64, i32, i64; bf16 too for a CUDA tensor.
void check_sum_dtype(const char* op, const Tensor& t);
// Checks t for reduce_scatter_sum over `size` ranks; returns n, the rows per rank.
int64_t check_reduce_scatter(const Tensor& t, int size);
// Checks t and counts for reduce_scatter_sum_v (op) or all_gather_v over `size`
// ranks; returns sum(counts).
int64_t check_counts_v(const char* op, const Tensor& t, const std::vector<int64_t>& counts, int size, int rank,
                       bool reduce);
// Checks the counts and returns the number of elements per row of `send`.
// Checks the ops of send_recv (defined tensors, peers in [0, size), one kind of device).
void check_send_recv(const std::vector<P2POp>& ops, int size);
int64_t check_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, int size);
}  // namespace detail

}  // namespace moetrain::comm
