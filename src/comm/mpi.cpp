// The MPI communicator (C API; Open MPI or MPICH). The only file that includes
// mpi.h. Every communicator it creates is a duplicate or a split of
// MPI_COMM_WORLD with MPI_ERRORS_RETURN, and every MPI return code is checked:
// a failure throws moetrain::Error naming the call, the ranks, the host and
// MPI's error text (MT_MPI_CHECK). Every blocking call runs inside a
// WatchdogWait (comm/watchdog.h), so dist.timeout_s ends a job stuck in it.
//
// CUDA tensors go to the communicator's NcclGroup (comm/nccl.h), which
// bootstraps NCCL through this communicator; everything here moves host memory.
//
// Counts: MPI takes int counts. all_gather and all_to_all_v move rows as one
// contiguous datatype of row_bytes bytes, so their counts and displacements are
// in rows (an error past 2^31-1 rows); all_reduce_sum, reduce_scatter_sum and
// broadcast loop over chunks of at most 2^30 elements (bytes for broadcast).
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_world.h"
#include "comm/nccl.h"
#include "comm/watchdog.h"

namespace moetrain::comm {

namespace {

constexpr int64_t kChunk = int64_t{1} << 30;

// Filled once MPI is initialised; used in every error message.
int g_world_rank = -1;
std::string g_host = "?";

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error code {}", code);
  return std::string(text, static_cast<size_t>(len));
}

// "MPI_Bcast (root 7, 16 bytes) failed on rank 0 of 2 in world (world rank 0,
// host node1): MPI_ERR_ROOT: invalid root"
[[noreturn]] void throw_mpi_error(int code, std::string_view call, std::string_view context, int rank, int size,
                                  std::string_view group) {
  std::string where = rank >= 0 ? fmt::format("rank {} of {} in {} (world rank {}, host {})", rank, size, group,
                                              g_world_rank, g_host)
                                : fmt::format("world rank {} (host {})", g_world_rank, g_host);
  throw Error(fmt::format("{}{} failed on {}: {}", call, context.empty() ? "" : fmt::format(" ({})", context),
                          where, mpi_error_text(code)));
}

// Calls before a communicator exists (initialisation).
void check_world(int code, std::string_view call) {
  if (code != MPI_SUCCESS) [[unlikely]]
    throw_mpi_error(code, call, "", -1, 0, "");
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

bool initialized_and_not_finalized() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

MPI_Datatype sum_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

class MpiCommunicator;

// start_all_reduce_sum on the CPU: the MPI_Iallreduce requests of t's chunks.
class MpiPendingSum final : public PendingCollective {
 public:
  MpiPendingSum(const MpiCommunicator& comm, Tensor t) : comm_(comm), t_(std::move(t)) {}
  ~MpiPendingSum() override;
  MpiPendingSum(const MpiPendingSum&) = delete;
  MpiPendingSum& operator=(const MpiPendingSum&) = delete;
  void wait() override;
  bool test() override;
  std::vector<MPI_Request>& requests() { return requests_; }

 private:
  const MpiCommunicator& comm_;
  Tensor t_;  // keeps the buffer alive while MPI writes it
  std::vector<MPI_Request> requests_;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed in the destructor).
  MpiCommunicator(MPI_Comm comm, std::string group) : comm_(comm), group_(std::move(group)), nccl_(*this) {
    // The size and rank are needed by error messages, so check these two by hand.
    check_world(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_world(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_world(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    // Communicators that outlive MPI (statics destroyed after the exit handler)
    // are gone with it.
    if (comm_ != MPI_COMM_NULL && initialized_and_not_finalized()) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& group() const { return group_; }
  std::string host() const override { return g_host; }

  void check(int code, std::string_view call, std::string_view context = {}) const {
    if (code != MPI_SUCCESS) [[unlikely]]
      throw_mpi_error(code, call, context, rank_, size_, group_);
  }

  std::unique_ptr<Communicator> split(int color, int key) const override {
    WatchdogWait wait("split");
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split",
          fmt::format("color {}, key {}", color, key));
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(sub, fmt::format("{}.split(color {})", group_, color));
  }

  void all_reduce_sum(Tensor& t) override {
    detail::check_sum_dtype("all_reduce_sum", t);
    if (t.is_cuda()) return nccl_.all_reduce_sum(t);
    WatchdogWait wait("all_reduce_sum");
    MPI_Datatype type = sum_type(t.dtype());
    char* p = static_cast<char*>(t.raw_data());
    const int64_t n = t.numel(), esize = dtype_size(t.dtype());
    int64_t at = 0;
    do {  // at least one call, so every rank issues the same number
      int count = static_cast<int>(std::min(kChunk, n - at));
      check(MPI_Allreduce(MPI_IN_PLACE, p + at * esize, count, type, MPI_SUM, comm_), "MPI_Allreduce",
            fmt::format("{}, elements [{}, {})", describe(t), at, at + count));
      at += count;
    } while (at < n);
  }

  std::unique_ptr<PendingCollective> start_all_reduce_sum(Tensor& t) override {
    detail::check_sum_dtype("start_all_reduce_sum", t);
    if (t.is_cuda()) return nccl_.start_all_reduce_sum(t);
    auto pending = std::make_unique<MpiPendingSum>(*this, t);
    MPI_Datatype type = sum_type(t.dtype());
    char* p = static_cast<char*>(t.raw_data());
    const int64_t n = t.numel(), esize = dtype_size(t.dtype());
    int64_t at = 0;
    do {  // the chunks of all_reduce_sum
      int count = static_cast<int>(std::min(kChunk, n - at));
      MPI_Request request = MPI_REQUEST_NULL;
      check(MPI_Iallreduce(MPI_IN_PLACE, p + at * esize, count, type, MPI_SUM, comm_, &request), "MPI_Iallreduce",
            fmt::format("{}, elements [{}, {})", describe(t), at, at + count));
      pending->requests().push_back(request);
      at += count;
    } while (at < n);
    return pending;
  }

  Tensor reduce_scatter_sum(const Tensor& t) override {
    const int64_t n = detail::check_reduce_scatter(t, size_);
    if (t.is_cuda()) return nccl_.reduce_scatter_sum(t);
    Tensor out = empty(t.shape().with(0, n), t.dtype());
    const int64_t block = out.numel(), esize = dtype_size(t.dtype());
    MPI_Datatype type = sum_type(t.dtype());
    const char* src = static_cast<const char*>(t.raw_data());
    char* dst = static_cast<char*>(out.raw_data());
    WatchdogWait wait("reduce_scatter_sum");
    if (block <= kChunk) {
      check(MPI_Reduce_scatter_block(src, dst, static_cast<int>(block), type, MPI_SUM, comm_),
            "MPI_Reduce_scatter_block", describe(t));
      return out;
    }
    // Blocks past MPI's int count: element range [at, at + count) of every
    // rank's block, packed side by side, per call.
    Tensor packed = empty(Shape{kChunk * size_}, t.dtype());
    char* pk = static_cast<char*>(packed.raw_data());
    for (int64_t at = 0; at < block; at += kChunk) {
      const int64_t count = std::min(kChunk, block - at);
      for (int r = 0; r < size_; ++r)
        std::memcpy(pk + r * count * esize, src + (r * block + at) * esize, static_cast<size_t>(count * esize));
      check(MPI_Reduce_scatter_block(pk, dst + at * esize, static_cast<int>(count), type, MPI_SUM, comm_),
            "MPI_Reduce_scatter_block",
            fmt::format("{}, elements [{}, {}) of each block", describe(t), at, at + count));
    }
    return out;
  }

  Tensor reduce_scatter_sum_v(const Tensor& t, const std::vector<int64_t>& counts) override {
    detail::check_counts_v("reduce_scatter_sum_v", t, counts, size_, rank_, true);
    if (t.is_cuda()) return nccl_.reduce_scatter_sum_v(t, counts);
    const std::vector<int> c(counts.begin(), counts.end());
    Tensor out = empty(Shape{counts[static_cast<size_t>(rank_)]}, t.dtype());
    WatchdogWait wait("reduce_scatter_sum_v");
    check(MPI_Reduce_scatter(t.raw_data(), out.raw_data(), c.data(), sum_type(t.dtype()), MPI_SUM, comm_),
          "MPI_Reduce_scatter", fmt::format("{}, counts [{}]", describe(t), fmt::join(counts, ", ")));
    return out;
  }

  Tensor all_gather_v(const Tensor& t, const std::vector<int64_t>& counts) override {
    const int64_t total = detail::check_counts_v("all_gather_v", t, counts, size_, rank_, false);
    if (t.is_cuda()) return nccl_.all_gather_v(t, counts);
    check_rows_fit("all_gather_v", total);
    std::vector<int> c(counts.begin(), counts.end()), displs(counts.size());
    for (size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + c[r - 1];
    Tensor out = empty(Shape{total}, t.dtype());
    RowType element(*this, dtype_size(t.dtype()));
    WatchdogWait wait("all_gather_v");
    check(MPI_Allgatherv(t.raw_data(), c[static_cast<size_t>(rank_)], element.type, out.raw_data(), c.data(),
                         displs.data(), element.type, comm_),
          "MPI_Allgatherv", fmt::format("{}, counts [{}]", describe(t), fmt::join(counts, ", ")));
    return out;
  }

  Tensor all_gather(const Tensor& t) override {
    detail::check_defined("all_gather", t);
    if (t.is_cuda()) return nccl_.all_gather(t);
    MT_CHECK(t.dim() >= 1, "all_gather: {} has no row dim (dim 0)", describe(t));
    const int64_t rows = t.size(0), row_bytes = t.shape().numel(1, t.dim()) * dtype_size(t.dtype());
    // Shapes must agree (else MPI truncates or reads garbage): one small exchange.
    WatchdogWait wait("all_gather");
    int64_t mine[3] = {rows, row_bytes, static_cast<int64_t>(t.dtype())};
    std::vector<int64_t> all(3 * static_cast<size_t>(size_));
    check(MPI_Allgather(mine, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, comm_), "MPI_Allgather",
          "shape check of all_gather");
    for (int r = 0; r < size_; ++r) {
      const int64_t* o = &all[3 * static_cast<size_t>(r)];
      MT_CHECK(o[0] == all[0] && o[1] == all[1] && o[2] == all[2],
               "all_gather: ranks pass different shapes: rank 0 has {} rows of {} bytes ({}), rank {} has {} rows of "
               "{} bytes ({}); every rank must pass the same shape (rank {} of {} in {} passes {})",
               all[0], all[1], static_cast<DType>(all[2]), r, o[0], o[1], static_cast<DType>(o[2]), rank_, size_,
               group_, describe(t));
    }
    check_rows_fit("all_gather", rows);
    Tensor out = empty(t.shape().with(0, rows * size_), t.dtype());
    RowType row(*this, row_bytes);
    check(MPI_Allgather(t.raw_data(), static_cast<int>(rows), row.type, out.raw_data(), static_cast<int>(rows),
                        row.type, comm_),
          "MPI_Allgather", fmt::format("{} rows of {} bytes", rows, row_bytes));
    return out;
  }

  void broadcast(Tensor& t, int root) override {
    // root is checked by MPI (MPI_ERR_ROOT), through the same error path.
    detail::check_defined("broadcast", t);
    if (t.is_cuda()) return nccl_.broadcast(t, root);
    WatchdogWait wait("broadcast");
    char* p = static_cast<char*>(t.raw_data());
    const int64_t n = t.nbytes();
    int64_t at = 0;
    do {
      int count = static_cast<int>(std::min(kChunk, n - at));
      check(MPI_Bcast(p + at, count, MPI_BYTE, root, comm_), "MPI_Bcast",
            fmt::format("root {}, {}", root, describe(t)));
      at += count;
    } while (at < n);
  }

  Tensor all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows,
                      const std::vector<int64_t>& recv_rows) override {
    const int64_t row_elems = detail::check_all_to_all_v(send, send_rows, recv_rows, size_);
    if (send.is_cuda()) return nccl_.all_to_all_v(send, send_rows, recv_rows);
    std::vector<int> send_counts(static_cast<size_t>(size_)), send_displs(send_counts.size());
    std::vector<int> recv_counts(send_counts.size()), recv_displs(send_counts.size());
    int64_t send_at = 0, recv_at = 0;
    for (size_t r = 0; r < send_counts.size(); ++r) {
      send_counts[r] = static_cast<int>(send_rows[r]);
      send_displs[r] = static_cast<int>(send_at);
      recv_counts[r] = static_cast<int>(recv_rows[r]);
      recv_displs[r] = static_cast<int>(recv_at);
      send_at += send_rows[r];
      recv_at += recv_rows[r];
      check_rows_fit("all_to_all_v (rows sent)", send_at);
      check_rows_fit("all_to_all_v (rows received)", recv_at);
    }
    Tensor out = empty(send.shape().with(0, recv_at), send.dtype());
    const int64_t row_bytes = row_elems * dtype_size(send.dtype());
    RowType row(*this, row_bytes);
    WatchdogWait wait("all_to_all_v");
    check(MPI_Alltoallv(send.raw_data(), send_counts.data(), send_displs.data(), row.type, out.raw_data(),
                        recv_counts.data(), recv_displs.data(), row.type, comm_),
          "MPI_Alltoallv",
          fmt::format("rows of {} bytes, send [{}], receive [{}]", row_bytes, fmt::join(send_rows, ", "),
                      fmt::join(recv_rows, ", ")));
    return out;
  }

  std::vector<int64_t> all_to_all_counts(const std::vector<int64_t>& send_counts) override {
    MT_CHECK(static_cast<int>(send_counts.size()) == size_,
             "all_to_all_counts: {} counts for a group of {} ranks; pass one per rank", send_counts.size(), size_);
    std::vector<int64_t> recv(send_counts.size());
    WatchdogWait wait("all_to_all_counts");
    check(MPI_Alltoall(send_counts.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, comm_), "MPI_Alltoall",
          "all_to_all_counts");
    return recv;
  }

  void barrier() override {
    WatchdogWait wait("barrier");
    check(MPI_Barrier(comm_), "MPI_Barrier");
  }

  void send_recv(std::vector<P2POp>& ops) override {
    detail::check_send_recv(ops, size_);
    if (ops.empty()) return;
    if (ops.front().tensor.is_cuda()) return nccl_.send_recv(ops);
    start_send_recv(std::move(ops))->wait();
  }

  std::unique_ptr<PendingCollective> start_send_recv(std::vector<P2POp> ops) override;

 private:
  // A committed datatype of `bytes` contiguous bytes: one row.
  struct RowType {
    MPI_Datatype type = MPI_DATATYPE_NULL;
    RowType(const MpiCommunicator& c, int64_t bytes) {
      MT_CHECK(bytes <= INT_MAX, "a row of {} bytes exceeds MPI's int count ({}); reshape to more, shorter rows",
               bytes, INT_MAX);
      c.check(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &type), "MPI_Type_contiguous");
      c.check(MPI_Type_commit(&type), "MPI_Type_commit");
    }
    ~RowType() {
      if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
    }
    RowType(const RowType&) = delete;
    RowType& operator=(const RowType&) = delete;
  };

  void check_rows_fit(const char* op, int64_t rows) const {
    MT_CHECK(rows <= INT_MAX,
             "{}: {} rows exceed MPI's int count ({}) on rank {} of {} in {}; exchange in several calls", op, rows,
             INT_MAX, rank_, size_, group_);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string group_;
  int rank_ = 0, size_ = 1;
  NcclGroup nccl_;  // CUDA tensors' collectives; its NCCL communicator is made on first use
};

void MpiPendingSum::wait() {
  if (requests_.empty()) return;
  WatchdogWait wait("all_reduce_sum (started earlier)");
  std::vector<MPI_Status> statuses(requests_.size());
  const int code = MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), statuses.data());
  requests_.clear();
  comm_.check(code, "MPI_Waitall", fmt::format("MPI_Iallreduce of {}", describe(t_)));
}

bool MpiPendingSum::test() {
  if (requests_.empty()) return true;
  int done = 0;
  std::vector<MPI_Status> statuses(requests_.size());
  comm_.check(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, statuses.data()),
              "MPI_Testall", fmt::format("MPI_Iallreduce of {}", describe(t_)));
  if (done) requests_.clear();  // MPI freed them
  return done != 0;
}

// start_send_recv on the CPU: the MPI_Isend/MPI_Irecv requests of the ops' chunks.
class MpiPendingP2P final : public PendingCollective {
 public:
  MpiPendingP2P(const MpiCommunicator& comm, std::vector<P2POp> ops) : comm_(comm), ops_(std::move(ops)) {}
  ~MpiPendingP2P() override;
  MpiPendingP2P(const MpiPendingP2P&) = delete;
  MpiPendingP2P& operator=(const MpiPendingP2P&) = delete;
  void wait() override;
  bool test() override;
  std::vector<P2POp>& ops() { return ops_; }
  std::vector<MPI_Request>& requests() { return requests_; }
  std::vector<int64_t>& expected() { return expected_; }

 private:
  // Receives are checked against the bytes they expected (a shorter message).
  void check_received(const std::vector<MPI_Status>& statuses);
  const MpiCommunicator& comm_;
  std::vector<P2POp> ops_;             // keeps every buffer alive while MPI reads or writes it
  std::vector<MPI_Request> requests_;
  std::vector<int64_t> expected_;      // bytes of each request (-1: a send)
};

MpiPendingSum::~MpiPendingSum() {
  if (requests_.empty() || !initialized_and_not_finalized()) return;
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moetrain: an all_reduce_sum never waited for failed: %s\n", e.what());
  }
}

std::unique_ptr<PendingCollective> MpiCommunicator::start_send_recv(std::vector<P2POp> ops) {
  detail::check_send_recv(ops, size_);
  if (ops.empty() || ops.front().tensor.is_cuda()) return Communicator::start_send_recv(std::move(ops));
  // Bytes in chunks of at most kChunk, each its own message with tag 0: messages of
  // one pair and direction are matched in posting order.
  auto pending = std::make_unique<MpiPendingP2P>(*this, std::move(ops));
  for (P2POp& op : pending->ops()) {
    char* p = static_cast<char*>(op.tensor.raw_data());
    const int64_t n = op.tensor.nbytes();
    int64_t at = 0;
    do {  // one message even for 0 bytes, so both sides post the same number
      const int count = static_cast<int>(std::min(kChunk, n - at));
      MPI_Request request = MPI_REQUEST_NULL;
      if (op.kind == P2POp::Kind::send)
        check(MPI_Isend(p + at, count, MPI_BYTE, op.peer, 0, comm_, &request), "MPI_Isend",
              fmt::format("to rank {}, {}", op.peer, describe(op.tensor)));
      else
        check(MPI_Irecv(p + at, count, MPI_BYTE, op.peer, 0, comm_, &request), "MPI_Irecv",
              fmt::format("from rank {}, {}", op.peer, describe(op.tensor)));
      pending->requests().push_back(request);
      pending->expected().push_back(op.kind == P2POp::Kind::recv ? count : -1);
      at += count;
    } while (at < n);
  }
  return pending;
}

void MpiPendingP2P::check_received(const std::vector<MPI_Status>& statuses) {
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (expected_[i] < 0) continue;
    int got = 0;
    comm_.check(MPI_Get_count(&statuses[i], MPI_BYTE, &got), "MPI_Get_count");
    MT_CHECK(got == expected_[i], "send_recv: a message from rank {} has {} bytes, {} were expected (rank {} of {} "
             "in {}): the sender passed another shape", statuses[i].MPI_SOURCE, got, expected_[i], comm_.rank(),
             comm_.size(), comm_.group());
  }
}

void MpiPendingP2P::wait() {
  if (requests_.empty()) return;
  std::vector<MPI_Status> statuses(requests_.size());
  int code = MPI_SUCCESS;
  {
    WatchdogWait wait("send_recv");
    code = MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), statuses.data());
  }
  requests_.clear();
  comm_.check(code, "MPI_Waitall", fmt::format("send_recv of {} transfers", ops_.size()));
  check_received(statuses);
  expected_.clear();
}

bool MpiPendingP2P::test() {
  if (requests_.empty()) return true;
  int done = 0;
  std::vector<MPI_Status> statuses(requests_.size());
  comm_.check(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, statuses.data()),
              "MPI_Testall", fmt::format("send_recv of {} transfers", ops_.size()));
  if (!done) return false;
  requests_.clear();  // MPI freed them
  check_received(statuses);
  expected_.clear();
  return true;
}

MpiPendingP2P::~MpiPendingP2P() {
  if (requests_.empty() || !initialized_and_not_finalized()) return;
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moetrain: a send_recv never waited for failed: %s\n", e.what());
  }
}

// The plugin's three entry points (comm/mpi_world.h).
std::unique_ptr<Communicator> plugin_world() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0, finalized = 0;
    check_world(MPI_Finalized(&finalized), "MPI_Finalized");
    MT_CHECK(!finalized, "MPI was finalised already; the world communicator must be created before exit");
    check_world(MPI_Initialized(&initialized), "MPI_Initialized");
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      check_world(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      std::atexit(finalize_at_exit);
    } else {
      check_world(MPI_Query_thread(&provided), "MPI_Query_thread");
    }
    check_world(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_world(MPI_Comm_rank(MPI_COMM_WORLD, &g_world_rank), "MPI_Comm_rank");
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    check_world(MPI_Get_processor_name(name, &len), "MPI_Get_processor_name");
    g_host.assign(name, static_cast<size_t>(len));
    MT_CHECK(provided >= MPI_THREAD_FUNNELED,
             "MPI provides thread level {} but moetrain needs MPI_THREAD_FUNNELED ({}): the main thread calls MPI "
             "while OpenMP threads run (world rank {}, host {})",
             provided, MPI_THREAD_FUNNELED, g_world_rank, g_host);
  });
  // A duplicate: our collectives never match messages of other users of the world.
  MPI_Comm dup = MPI_COMM_NULL;
  check_world(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup");
  return std::make_unique<MpiCommunicator>(dup, "world");
}

bool plugin_active() { return initialized_and_not_finalized(); }

void plugin_abort(int exit_code) {
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; in case it does
}

const detail::MpiPlugin kPlugin{detail::kMpiPluginAbi, sizeof(Communicator), plugin_world, plugin_active,
                                plugin_abort};

}  // namespace

}  // namespace moetrain::comm

// The entry point communicator.cpp looks up with dlsym (comm/mpi_world.h).
extern "C" __attribute__((visibility("default"))) const moetrain::comm::detail::MpiPlugin* moetrain_mpi_plugin() {
  return &moetrain::comm::kPlugin;
}
