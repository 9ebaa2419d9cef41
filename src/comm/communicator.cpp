// The one-process communicator, the choice of the world communicator, and the
// argument checks every implementation shares.
#include "comm/communicator.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string_view>

#include "comm/mpi_world.h"

namespace moetrain::comm {

namespace detail {

void check_cpu_tensor(const char* op, const Tensor& t) {
  MT_CHECK(t.defined(), "{}: the tensor is undefined", op);
  MT_CHECK(t.is_cpu(), "{}: {} is not on the CPU; the MPI communicator exchanges host memory, copy it with .to(kCpu)",
           op, describe(t));
}

int64_t check_all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, int size) {
  check_cpu_tensor("all_to_all_v", send);
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

}  // namespace detail

namespace {

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

  void all_reduce_sum(Tensor& t) override {
    detail::check_cpu_tensor("all_reduce_sum", t);
    MT_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::i32 ||
                 t.dtype() == DType::i64,
             "all_reduce_sum: {} has dtype {}; sums are of f32, f64, i32 or i64 (convert bf16 to f32 first)",
             describe(t), t.dtype());
  }

  Tensor all_gather(const Tensor& t) override {
    detail::check_cpu_tensor("all_gather", t);
    MT_CHECK(t.dim() >= 1, "all_gather: {} has no row dim (dim 0)", describe(t));
    return t.detach().clone();
  }

  void broadcast(Tensor& t, int root) override {
    detail::check_cpu_tensor("broadcast", t);
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

bool launched_with_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    const char* v = std::getenv(var);
    if (v && *v) return true;
  }
  return false;
}

Communicator& world() {
  static const std::unique_ptr<Communicator> instance = use_mpi() ? detail::mpi_world() : single_process();
  return *instance;
}

bool mpi_active() { return detail::mpi_active(); }

void abort_job(int exit_code) {
  if (detail::mpi_active()) detail::mpi_abort(exit_code);
  std::exit(exit_code);
}

}  // namespace moetrain::comm
