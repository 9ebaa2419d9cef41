// The one-process communicator, the choice of the world communicator, and the
// argument checks every implementation shares.
#include "comm/communicator.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string_view>

#include "comm/mpi_world.h"

namespace moetrain::comm {

namespace detail {

void check_defined(const char* op, const Tensor& t) { MT_CHECK(t.defined(), "{}: the tensor is undefined", op); }

void check_sum_dtype(const char* op, const Tensor& t) {
  check_defined(op, t);
  const DType d = t.dtype();
  if (d == DType::f32 || d == DType::f64 || d == DType::i32 || d == DType::i64) return;
  MT_CHECK(d == DType::bf16 && t.is_cuda(),
           "{}: {} has dtype {}; sums are of f32, f64, i32 or i64, and of bf16 on CUDA only (convert to f32 first)",
           op, describe(t), d);
}

int64_t check_reduce_scatter(const Tensor& t, int size) {
  check_sum_dtype("reduce_scatter_sum", t);
  MT_CHECK(t.dim() >= 1 && t.size(0) % size == 0,
           "reduce_scatter_sum: {} must have a row dim (dim 0) of size * n rows, one block of n rows per rank; the "
           "group has {} ranks",
           describe(t), size);
  return t.size(0) / size;
}

int64_t check_counts_v(const char* op, const Tensor& t, const std::vector<int64_t>& counts, int size, int rank,
                       bool reduce) {
  if (reduce) check_sum_dtype(op, t);
  else check_defined(op, t);
  MT_CHECK(static_cast<int>(counts.size()) == size, "{}: {} counts for a group of {} ranks; pass one per rank", op,
           counts.size(), size);
  int64_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    MT_CHECK(counts[r] >= 0 && counts[r] <= INT32_MAX,
             "{}: the count for rank {} is {}; counts are in [0, 2^31) (split larger exchanges)", op, r, counts[r]);
    total += counts[r];
  }
  MT_CHECK(t.dim() == 1, "{}: {} must be flat (one dim)", op, describe(t));
  const int64_t want = reduce ? total : counts[static_cast<size_t>(rank)];
  MT_CHECK(t.numel() == want, "{}: {} has {} elements, the counts [{}] say {} (rank {} of {})", op, describe(t),
           t.numel(), fmt::join(counts, ", "), want, rank, size);
  return total;
}

int64_t check_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, int size) {
  check_defined("all_to_all_v", send);
  MT_CHECK(send.dim() >= 1, "all_to_all_v: send must have a row dim (dim 0), got the scalar {}", describe(send));
  MT_CHECK(static_cast<int>(send_rows.size()) == size && static_cast<int>(recv_rows.size()) == size,
           "all_to_all_v: {} send counts and {} receive counts for a group of {} ranks; pass one per rank",
           send_rows.size(), recv_rows.size(), size);
  int64_t total = 0;
  for (size_t r = 0; r < send_rows.size(); ++r) {
    MT_CHECK(send_rows[r] >= 0 && recv_rows[r] >= 0,
             "all_to_all_v: negative row count for rank {} (send {}, receive {})", r, send_rows[r], recv_rows[r]);
    total += send_rows[r];
  }
  MT_CHECK(total == send.size(0), "all_to_all_v: send_rows [{}] sum to {} but send {} has {} rows",
           fmt::join(send_rows, ", "), total, send.shape(), send.size(0));
  return send.shape().numel(1, send.dim());
}

void check_send_recv(const std::vector<P2POp>& ops, int size) {
  for (const P2POp& op : ops) {
    const char* what = op.kind == P2POp::Kind::send ? "send" : "receive";
    MT_CHECK(op.tensor.defined(), "send_recv: a {} to/from rank {} has no tensor", what, op.peer);
    MT_CHECK(op.peer >= 0 && op.peer < size, "send_recv: a {} names rank {}, not a rank of this group of {}", what,
             op.peer, size);
    MT_CHECK(op.tensor.is_cuda() == ops.front().tensor.is_cuda(),
             "send_recv: {} mixes CPU and CUDA tensors in one call; pass one kind", describe(op.tensor));
  }
}

}  // namespace detail

namespace {

// The sum over one rank is already there.
class DoneCollective final : public PendingCollective {
 public:
  void wait() override {}
  bool test() override { return true; }
};

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string host() const override {
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
    return name;
  }

  std::unique_ptr<Communicator> split(int color, int /*key*/) const override {
    if (color < 0) return nullptr;
    return std::make_unique<LocalCommunicator>();
  }

  // On either device: the sum of one is t, and the copies below are copy_ on the
  // tensor's device (on a GPU: queued on its stream like any other copy).
  void all_reduce_sum(Tensor& t) override { detail::check_sum_dtype("all_reduce_sum", t); }
  std::unique_ptr<PendingCollective> start_all_reduce_sum(Tensor& t) override {
    detail::check_sum_dtype("start_all_reduce_sum", t);
    return std::make_unique<DoneCollective>();
  }

  Tensor reduce_scatter_sum(const Tensor& t) override {
    detail::check_reduce_scatter(t, 1);
    return t.detach().clone();
  }

  Tensor reduce_scatter_sum_v(const Tensor& t, const std::vector<int64_t>& counts) override {
    detail::check_counts_v("reduce_scatter_sum_v", t, counts, 1, 0, true);
    return t.detach().clone();
  }

  Tensor all_gather(const Tensor& t) override {
    detail::check_defined("all_gather", t);
    MT_CHECK(t.dim() >= 1, "all_gather: {} has no row dim (dim 0)", describe(t));
    return t.detach().clone();
  }

  Tensor all_gather_v(const Tensor& t, const std::vector<int64_t>& counts) override {
    detail::check_counts_v("all_gather_v", t, counts, 1, 0, false);
    return t.detach().clone();
  }

  void broadcast(Tensor& t, int root) override {
    detail::check_defined("broadcast", t);
    MT_CHECK(root == 0, "broadcast: root {} is not a rank of this one-process group (rank 0 only)", root);
  }

  Tensor all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows,
                      const std::vector<int64_t>& recv_rows) override {
    detail::check_all_to_all_v(send, send_rows, recv_rows, 1);
    MT_CHECK(recv_rows[0] == send_rows[0],
             "all_to_all_v: this one-process group sends itself {} rows but expects to receive {}", send_rows[0],
             recv_rows[0]);
    return send.detach().clone();
  }

  std::vector<int64_t> all_to_all_counts(const std::vector<int64_t>& send_counts) override {
    MT_CHECK(send_counts.size() == 1, "all_to_all_counts: {} counts for a group of 1 rank; pass one per rank",
             send_counts.size());
    return send_counts;
  }

  void barrier() override {}

  void send_recv(std::vector<P2POp>& ops) override {
    detail::check_send_recv(ops, 1);
    std::vector<const P2POp*> sends, recvs;
    for (const P2POp& op : ops) (op.kind == P2POp::Kind::send ? sends : recvs).push_back(&op);
    MT_CHECK(sends.size() == recvs.size(), "send_recv: this one-process group sends itself {} tensors but receives {}",
             sends.size(), recvs.size());
    for (size_t k = 0; k < sends.size(); ++k) {
      const Tensor &src = sends[k]->tensor, &dst = recvs[k]->tensor;
      MT_CHECK(src.shape() == dst.shape() && src.dtype() == dst.dtype(),
               "send_recv: send {} ({}) does not match receive {} ({})", k, describe(src), k, describe(dst));
      copy_(dst, src.detach());
    }
  }
};

// A start_send_recv that finished inside the call.
class DoneSendRecv final : public PendingCollective {
 public:
  void wait() override {}
  bool test() override { return true; }
};

// MOETRAIN_MPI: unset -> follow the launcher; 1 -> MPI; 0 -> one process.
bool use_mpi() {
  const char* v = std::getenv("MOETRAIN_MPI");
  if (!v || !*v) return launched_with_mpi();
  std::string_view s(v);
  if (s == "1") return true;
  if (s == "0") return false;
  MT_THROW("environment variable MOETRAIN_MPI={} must be 1 (use MPI) or 0 (one process); unset, MPI is used "
           "when launched by mpirun/srun",
           s);
}

}  // namespace

std::unique_ptr<Communicator> single_process() { return std::make_unique<LocalCommunicator>(); }

std::unique_ptr<PendingCollective> Communicator::start_send_recv(std::vector<P2POp> ops) {
  send_recv(ops);
  return std::make_unique<DoneSendRecv>();
}

bool launched_with_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    const char* v = std::getenv(var);
    if (v && *v) return true;
  }
  return false;
}

Communicator& world() {
  static const std::unique_ptr<Communicator> instance =
      use_mpi() ? detail::load_mpi_plugin().world() : single_process();
  return *instance;
}

bool mpi_active() {
  const detail::MpiPlugin* mpi = detail::loaded_mpi_plugin();
  return mpi && mpi->active();
}

void abort_job(int exit_code) {
  if (const detail::MpiPlugin* mpi = detail::loaded_mpi_plugin(); mpi && mpi->active()) mpi->abort(exit_code);
  std::exit(exit_code);
}

}  // namespace moetrain::comm
