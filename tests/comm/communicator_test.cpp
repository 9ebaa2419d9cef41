// The shared Communicator suite: every implementation (one process, the MPI
// world, split MPI groups) runs the same checks. Expected values are computed
// by each rank on its own from (rank, size), never by another collective.
//
// [comm][cuda] cases run the collectives on CUDA tensors (NCCL under MPI) and
// compare them with the CPU path; they return at once without a GPU.
//
// [comm][mpi] cases run under mpirun (ctest comm_mpi_np2, comm_mpi_np4) and, in
// a plain run, with the one-process world. They use CHECK rather than REQUIRE
// after the first collective, so a failing rank keeps issuing the collectives
// its peers wait for.
#include <catch2/catch.hpp>

#include <cstdlib>

#include "comm/communicator.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using namespace moetrain::comm;
using moetrain::testing::bitwise_equal;
using moetrain::testing::error_of;
using moetrain::testing::gpu_available;

namespace {

// Rows rank src sends to rank dst in the all_to_all_v pattern: 0, 1 or 2, so
// some pairs exchange nothing.
int64_t rows_between(int src, int dst) { return (src + 2 * dst + 1) % 3; }

// Element c of row j of the block src sends to dst.
double stamp(int src, int dst, int64_t j, int64_t c) { return src * 1000 + dst * 100 + j * 10 + c; }

void check_all_reduce(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  for (DType dt : {DType::f32, DType::f64, DType::i32, DType::i64}) {
    INFO("dtype " << dtype_name(dt));
    std::vector<double> mine(7);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = (r + 1) * static_cast<double>(i + 1) - 3;
    Tensor t = from_vector(mine, Shape{7}, dt);
    comm.all_reduce_sum(t);
    std::vector<double> got = t.to_vector();
    for (size_t i = 0; i < mine.size(); ++i) {
      double expected = 0;
      for (int q = 0; q < n; ++q) expected += (q + 1) * static_cast<double>(i + 1) - 3;
      CHECK(got[i] == expected);
    }
  }
  // i64 beyond 32 bits: summed as 64-bit integers.
  Tensor big = from_vector({static_cast<double>((int64_t{1} << 40) * (r + 1))}, Shape{1}, DType::i64);
  comm.all_reduce_sum(big);
  CHECK(big.item<int64_t>() == (int64_t{1} << 40) * n * (n + 1) / 2);
  // An empty tensor is a valid (empty) sum.
  Tensor none = empty(Shape{0, 3}, DType::f32);
  comm.all_reduce_sum(none);
  CHECK(none.numel() == 0);
}

// Rank r's element (row j, column c) of the reduce_scatter_sum input.
double scatter_value(int r, int64_t j, int64_t c) { return (r + 1) * static_cast<double>(j * 3 + c + 1) - 5; }

void check_reduce_scatter(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  for (DType dt : {DType::f32, DType::f64, DType::i32, DType::i64}) {
    INFO("dtype " << dtype_name(dt));
    std::vector<double> mine;
    for (int64_t j = 0; j < 2 * n; ++j)
      for (int64_t c = 0; c < 3; ++c) mine.push_back(scatter_value(r, j, c));
    Tensor out = comm.reduce_scatter_sum(from_vector(mine, Shape{2 * n, 3}, dt));
    REQUIRE(out.shape() == Shape{2, 3});
    CHECK(out.dtype() == dt);
    std::vector<double> got = out.to_vector();
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t c = 0; c < 3; ++c) {
        double expected = 0;  // rows [2r, 2r + 2) of the sum
        for (int q = 0; q < n; ++q) expected += scatter_value(q, 2 * r + j, c);
        CHECK(got[static_cast<size_t>(j * 3 + c)] == expected);
      }
  }
  Tensor none = comm.reduce_scatter_sum(empty(Shape{0, 4}, DType::f32));
  CHECK(none.shape() == Shape{0, 4});
}

// The variable-count forms: rank q gets q + 1 elements (rank 0 of a group of
// several also gets none in a second round), values stamped with the position.
void check_variable_counts(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  for (bool with_empty : {false, true}) {
    std::vector<int64_t> counts;
    for (int q = 0; q < n; ++q) counts.push_back(with_empty && q == 0 && n > 1 ? 0 : q + 1);
    int64_t total = 0, mine_at = 0;
    for (int q = 0; q < n; ++q) {
      if (q == r) mine_at = total;
      total += counts[static_cast<size_t>(q)];
    }
    for (DType dt : {DType::f32, DType::f64, DType::i64}) {
      INFO("dtype " << dtype_name(dt) << (with_empty ? ", rank 0 gets none" : ""));
      std::vector<double> all;
      for (int64_t j = 0; j < total; ++j) all.push_back(scatter_value(r, j, 0));
      const Tensor sum = comm.reduce_scatter_sum_v(from_vector(all, Shape{total}, dt), counts);
      REQUIRE(sum.shape() == Shape{counts[static_cast<size_t>(r)]});
      std::vector<double> got = sum.to_vector();
      for (int64_t j = 0; j < sum.numel(); ++j) {
        double expected = 0;
        for (int q = 0; q < n; ++q) expected += scatter_value(q, mine_at + j, 0);
        CHECK(got[static_cast<size_t>(j)] == expected);
      }
      std::vector<double> mine;
      for (int64_t j = 0; j < counts[static_cast<size_t>(r)]; ++j) mine.push_back(stamp(r, 0, j, 1));
      const Tensor gathered = comm.all_gather_v(from_vector(mine, Shape{counts[static_cast<size_t>(r)]}, dt), counts);
      REQUIRE(gathered.shape() == Shape{total});
      got = gathered.to_vector();
      int64_t at = 0;
      for (int q = 0; q < n; ++q)
        for (int64_t j = 0; j < counts[static_cast<size_t>(q)]; ++j)
          CHECK(got[static_cast<size_t>(at++)] == stamp(q, 0, j, 1));
    }
  }
  CHECK_THAT(error_of([&] { comm.all_gather_v(zeros(Shape{3}), std::vector<int64_t>(static_cast<size_t>(n), 2)); }),
             Catch::Contains("all_gather_v") && Catch::Contains("3 elements"));
  CHECK_THAT(error_of([&] { comm.reduce_scatter_sum_v(zeros(Shape{2}), {1}); }),
             Catch::Contains("reduce_scatter_sum_v") &&
                 (n == 1 ? Catch::Contains("2 elements") : Catch::Contains("counts for a group")));
}

void check_all_gather(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  for (DType dt : {DType::f32, DType::i64, DType::f64}) {
    INFO("dtype " << dtype_name(dt));
    std::vector<double> mine;
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t c = 0; c < 4; ++c) mine.push_back(stamp(r, 0, j, c));
    Tensor out = comm.all_gather(from_vector(mine, Shape{3, 2, 2}, dt));
    CHECK(out.shape() == Shape{3 * n, 2, 2});
    CHECK(out.dtype() == dt);
    std::vector<double> got = out.to_vector();
    for (int q = 0; q < n; ++q)
      for (int64_t j = 0; j < 3; ++j)
        for (int64_t c = 0; c < 4; ++c) CHECK(got[static_cast<size_t>((q * 3 + j) * 4 + c)] == stamp(q, 0, j, c));
  }
  Tensor empty_rows = comm.all_gather(empty(Shape{0, 5}, DType::f32));
  CHECK(empty_rows.shape() == Shape{0, 5});
}

void check_broadcast(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  for (int root = 0; root < n; ++root) {
    INFO("root " << root);
    std::vector<double> theirs;
    for (int64_t j = 0; j < 5; ++j) theirs.push_back(stamp(root, 0, j, 0));
    Tensor t = r == root ? from_vector(theirs, Shape{5}, DType::f64) : zeros(Shape{5}, DType::f64);
    comm.broadcast(t, root);
    CHECK(t.to_vector() == theirs);
  }
}

void check_all_to_all_v(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  std::vector<int64_t> send_rows, recv_rows;
  for (int q = 0; q < n; ++q) {
    send_rows.push_back(rows_between(r, q));
    recv_rows.push_back(rows_between(q, r));
  }
  for (DType dt : {DType::f32, DType::i64}) {
    INFO("dtype " << dtype_name(dt));
    std::vector<double> send;
    for (int q = 0; q < n; ++q)
      for (int64_t j = 0; j < send_rows[static_cast<size_t>(q)]; ++j)
        for (int64_t c = 0; c < 6; ++c) send.push_back(stamp(r, q, j, c));
    const int64_t total_send = static_cast<int64_t>(send.size()) / 6;
    Tensor out = comm.all_to_all_v(from_vector(send, Shape{total_send, 2, 3}, dt), send_rows, recv_rows);
    int64_t total_recv = 0;
    for (int64_t k : recv_rows) total_recv += k;
    CHECK(out.shape() == Shape{total_recv, 2, 3});
    std::vector<double> got = out.to_vector();
    size_t at = 0;
    for (int q = 0; q < n; ++q)  // from every source in rank order, its rows in order
      for (int64_t j = 0; j < recv_rows[static_cast<size_t>(q)]; ++j)
        for (int64_t c = 0; c < 6; ++c, ++at) {
          INFO("from rank " << q << " row " << j << " element " << c);
          CHECK(got[at] == stamp(q, r, j, c));
        }
  }
  // No rows at all.
  std::vector<int64_t> zero(static_cast<size_t>(n), 0);
  Tensor none = comm.all_to_all_v(empty(Shape{0, 4}, DType::f32), zero, zero);
  CHECK(none.shape() == Shape{0, 4});
  // Everything to rank 0.
  std::vector<int64_t> to_first(static_cast<size_t>(n), 0), from_all(static_cast<size_t>(n), 0);
  to_first[0] = 2;
  if (r == 0) from_all.assign(static_cast<size_t>(n), 2);
  Tensor gathered = comm.all_to_all_v(full(Shape{2, 1}, r, DType::f64), to_first, from_all);
  CHECK(gathered.size(0) == (r == 0 ? 2 * n : 0));
  if (r == 0)
    for (int q = 0; q < n; ++q) CHECK(gathered.to_vector()[static_cast<size_t>(2 * q + 1)] == q);
}

// Messages past the shared-memory eager limit (a few KiB): the rendezvous path.
void check_large_messages(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  const int64_t len = 1 << 18;  // 1 MiB of f32
  Tensor t = empty(Shape{len}, DType::f32);
  for (int64_t i = 0; i < len; ++i) t.data<float>()[i] = static_cast<float>((r + 1) * (i % 7));
  comm.all_reduce_sum(t);
  int64_t wrong = 0;
  for (int64_t i = 0; i < len; ++i) wrong += t.data<float>()[i] != static_cast<float>(n * (n + 1) / 2 * (i % 7));
  CHECK(wrong == 0);

  const int64_t cols = 3000;  // 12 KB rows; rank r sends r + q + 1 rows to q
  std::vector<int64_t> send_rows, recv_rows;
  for (int q = 0; q < n; ++q) send_rows.push_back(r + q + 1), recv_rows.push_back(q + r + 1);
  int64_t num_send = 0, num_recv = 0;
  for (int q = 0; q < n; ++q) num_send += send_rows[static_cast<size_t>(q)], num_recv += recv_rows[static_cast<size_t>(q)];
  Tensor send = empty(Shape{num_send, cols}, DType::f32);
  float* p = send.data<float>();
  for (int q = 0, row = 0; q < n; ++q)
    for (int64_t j = 0; j < send_rows[static_cast<size_t>(q)]; ++j, ++row)
      for (int64_t c = 0; c < cols; ++c) p[row * cols + c] = static_cast<float>(stamp(r, q, j, c % 10) + c / 10 * 0.5);
  Tensor out = comm.all_to_all_v(send, send_rows, recv_rows);
  REQUIRE(out.shape() == Shape{num_recv, cols});
  const float* o = out.data<float>();
  wrong = 0;
  for (int q = 0, row = 0; q < n; ++q)
    for (int64_t j = 0; j < recv_rows[static_cast<size_t>(q)]; ++j, ++row)
      for (int64_t c = 0; c < cols; ++c)
        wrong += o[row * cols + c] != static_cast<float>(stamp(q, r, j, c % 10) + c / 10 * 0.5);
  CHECK(wrong == 0);
}

void check_counts(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  std::vector<int64_t> send;
  for (int q = 0; q < n; ++q) send.push_back(int64_t{10000000000} * r + q);
  std::vector<int64_t> recv = comm.all_to_all_counts(send);
  REQUIRE(recv.size() == static_cast<size_t>(n));
  for (int q = 0; q < n; ++q) CHECK(recv[static_cast<size_t>(q)] == int64_t{10000000000} * q + r);
}

void check_split(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  // Two groups by parity, each in reverse rank order (key = -rank).
  std::unique_ptr<Communicator> half = comm.split(r % 2, -r);
  REQUIRE(half != nullptr);
  const int members = (n - r % 2 + 1) / 2;  // ranks of this parity
  CHECK(half->size() == members);
  int bigger = 0;  // same parity, higher rank: ordered first
  for (int q = r + 2; q < n; q += 2) ++bigger;
  CHECK(half->rank() == bigger);
  Tensor t = from_vector({static_cast<double>(r)}, Shape{1}, DType::i64);
  half->all_reduce_sum(t);
  int64_t expected = 0;
  for (int q = r % 2; q < n; q += 2) expected += q;
  CHECK(t.item<int64_t>() == expected);
  // kNoGroup: rank 0 joins nothing; the others form one group.
  std::unique_ptr<Communicator> rest = comm.split(r == 0 ? kNoGroup : 7, 0);
  CHECK((rest == nullptr) == (r == 0));
  if (rest) CHECK(rest->size() == n - 1);
}

// Checks needing no peers: every rank throws before communicating.
void check_argument_errors(Communicator& comm) {
  const int n = comm.size();
  std::vector<int64_t> ones(static_cast<size_t>(n), 1);
  Tensor x = zeros(Shape{n, 2}, DType::f32);
  CHECK_THAT(error_of([&] { comm.all_to_all_v(x, {1}, {1, 1, 1, 1, 1}); }),
             Catch::Contains("all_to_all_v") && Catch::Contains("pass one per rank"));
  std::vector<int64_t> too_many = ones;
  too_many[0] = 3;
  CHECK_THAT(error_of([&] { comm.all_to_all_v(x, too_many, ones); }),
             Catch::Contains("sum to " + std::to_string(n + 2)) && Catch::Contains("has " + std::to_string(n)));
  std::vector<int64_t> negative = ones;
  negative[0] = -1;
  CHECK_THAT(error_of([&] { comm.all_to_all_v(x, ones, negative); }), Catch::Contains("negative row count"));
  Tensor half = zeros(Shape{3}, DType::bf16);
  CHECK_THAT(error_of([&] { comm.all_reduce_sum(half); }),
             Catch::Contains("all_reduce_sum") && Catch::Contains("bf16"));
  CHECK_THAT(error_of([&] { comm.all_to_all_counts(std::vector<int64_t>(static_cast<size_t>(n + 1), 0)); }),
             Catch::Contains("all_to_all_counts") && Catch::Contains("pass one per rank"));
  CHECK_THAT(error_of([&] { comm.reduce_scatter_sum(zeros(Shape{n + 1, 2}, DType::bf16)); }),
             Catch::Contains("reduce_scatter_sum") && Catch::Contains("bf16"));
  if (n > 1)
    CHECK_THAT(error_of([&] { comm.reduce_scatter_sum(zeros(Shape{n + 1, 2})); }),
               Catch::Contains("reduce_scatter_sum") && Catch::Contains("size * n rows") &&
                   Catch::Contains(fmt::format("has {} ranks", n)));
}

// send_recv: a ring in both directions at once (each rank sends to both
// neighbours and receives from both: the pattern of a pipeline's paired
// exchanges), several tensors per peer arriving in posting order, f64 and i32;
// a receive of the wrong size is an error naming the sender. One rank: itself.
void check_send_recv(Communicator& comm) {
  const int n = comm.size(), r = comm.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  auto stamp = [](int from, int to, int k) {
    return from_vector({1000.0 * from + 10.0 * to + k, -1.0 * k, 0.5}, Shape{3}, DType::f64);
  };
  Tensor to_next0 = stamp(r, next, 0), to_next1 = stamp(r, next, 1), to_prev = stamp(r, prev, 2);
  Tensor from_prev0 = zeros(Shape{3}, DType::f64), from_prev1 = zeros(Shape{3}, DType::f64);
  Tensor from_next = zeros(Shape{3}, DType::f64);
  Tensor ids = from_vector({static_cast<double>(r)}, Shape{1}, DType::i32), got_id = zeros(Shape{1}, DType::i32);
  std::vector<P2POp> ops{{P2POp::Kind::send, next, to_next0},   {P2POp::Kind::recv, prev, from_prev0},
                         {P2POp::Kind::send, prev, to_prev},    {P2POp::Kind::recv, next, from_next},
                         {P2POp::Kind::send, next, to_next1},   {P2POp::Kind::recv, prev, from_prev1},
                         {P2POp::Kind::send, next, ids},        {P2POp::Kind::recv, prev, got_id}};
  comm.send_recv(ops);
  CHECK(bitwise_equal(from_prev0, stamp(prev, r, 0)));
  CHECK(bitwise_equal(from_prev1, stamp(prev, r, 1)));
  CHECK(bitwise_equal(from_next, stamp(next, r, 2)));
  CHECK(got_id.data<int32_t>()[0] == prev);
  std::vector<P2POp> bad_peer{{P2POp::Kind::send, n, to_next0}};
  CHECK_THAT(error_of([&] { comm.send_recv(bad_peer); }),
             Catch::Contains("send_recv") && Catch::Contains(fmt::format("not a rank of this group of {}", n)));
  if (n > 1) {  // a receive longer than what the peer sends
    Tensor small = zeros(Shape{2}, DType::f64), large = zeros(Shape{4}, DType::f64);
    std::vector<P2POp> mismatched{{P2POp::Kind::send, next, small}, {P2POp::Kind::recv, prev, large}};
    CHECK_THAT(error_of([&] { comm.send_recv(mismatched); }),
               Catch::Contains("send_recv") && Catch::Contains("16 bytes, 32 were expected") &&
                   Catch::Contains("another shape"));
  }
}

// start_send_recv: three batches started one after another without waiting (the
// pipeline's ticks), the later ones waited first; every tensor arrives in posting
// order, the handles keep the buffers alive (the caller's copies are dropped), and a
// receive of the wrong size is reported by wait().
void check_start_send_recv(Communicator& comm) {
  const int n = comm.size(), r = comm.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  auto stamp = [](int from, int k) { return from_vector({100.0 * from + k, -2.0 * k}, Shape{2}, DType::f64); };
  std::vector<Tensor> got;
  std::vector<std::unique_ptr<PendingCollective>> started;
  for (int k = 0; k < 3; ++k) {
    got.push_back(zeros(Shape{2}, DType::f64));
    started.push_back(comm.start_send_recv({{P2POp::Kind::send, next, stamp(r, k)}, {P2POp::Kind::recv, prev, got.back()}}));
  }
  for (int k = 2; k >= 0; --k) started[static_cast<size_t>(k)]->wait();
  for (int k = 0; k < 3; ++k) CHECK(bitwise_equal(got[static_cast<size_t>(k)], stamp(prev, k)));
  if (n > 1) {
    Tensor large = zeros(Shape{4}, DType::f64);
    auto bad = comm.start_send_recv({{P2POp::Kind::send, next, zeros(Shape{2}, DType::f64)},
                                     {P2POp::Kind::recv, prev, large}});
    CHECK_THAT(error_of([&] { bad->wait(); }), Catch::Contains("16 bytes, 32 were expected"));
  }
}

void check_suite(Communicator& comm) {
  INFO("rank " << comm.rank() << " of " << comm.size() << " on " << comm.host());
  CHECK(!comm.host().empty());
  check_all_reduce(comm);
  check_reduce_scatter(comm);
  check_variable_counts(comm);
  check_all_gather(comm);
  check_broadcast(comm);
  check_all_to_all_v(comm);
  check_large_messages(comm);
  check_counts(comm);
  check_split(comm);
  check_argument_errors(comm);
  check_send_recv(comm);
  check_start_send_recv(comm);
  comm.barrier();
}

}  // namespace

TEST_CASE("comm: the one-process communicator passes the communicator suite", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  CHECK(one->rank() == 0);
  CHECK(one->size() == 1);
  check_suite(*one);
  CHECK_THAT(error_of([&] {
               Tensor t = zeros(Shape{2});
               one->broadcast(t, 1);
             }),
             Catch::Contains("root 1"));
  CHECK_THAT(error_of([&] { one->all_to_all_v(zeros(Shape{2, 1}), {2}, {1}); }),
             Catch::Contains("expects to receive 1"));
}

TEST_CASE("comm: the world follows the launcher", "[comm][mpi]") {
  Communicator& w = world();
  const char* launched_size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* launched_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (launched_size && launched_rank) {
    CHECK(launched_with_mpi());
    CHECK(mpi_active());
    CHECK(w.size() == std::atoi(launched_size));
    CHECK(w.rank() == std::atoi(launched_rank));
  } else if (const char* forced = std::getenv("MOETRAIN_MPI"); forced && std::string(forced) == "1") {
    CHECK(mpi_active());  // a singleton MPI world
    CHECK(w.size() == 1);
  } else if (!launched_with_mpi()) {
    CHECK(w.size() == 1);
    CHECK(!mpi_active());
  }
  CHECK(&world() == &w);
}

TEST_CASE("comm: the world communicator passes the communicator suite", "[comm][mpi]") { check_suite(world()); }

TEST_CASE("comm: split groups pass the communicator suite", "[comm][mpi]") {
  Communicator& w = world();
  // Groups of two consecutive ranks (the last alone when the size is odd) ...
  std::unique_ptr<Communicator> pairs = w.split(w.rank() / 2, w.rank());
  REQUIRE(pairs != nullptr);
  check_suite(*pairs);
  // ... and the whole world in reverse order.
  std::unique_ptr<Communicator> reversed = w.split(0, w.size() - w.rank());
  REQUIRE(reversed != nullptr);
  CHECK(reversed->rank() == w.size() - 1 - w.rank());
  check_suite(*reversed);
}

TEST_CASE("comm: all_gather refuses ranks with different shapes", "[comm][mpi]") {
  Communicator& w = world();
  if (w.size() < 2) return;
  const int64_t rows = w.rank() == w.size() - 1 ? 3 : 2;
  std::string message = error_of([&] { w.all_gather(zeros(Shape{rows, 4})); });
  CHECK_THAT(message, Catch::Contains("all_gather: ranks pass different shapes") &&
                          Catch::Contains("rank " + std::to_string(w.size() - 1) + " has 3 rows"));
  // The communicator is still usable.
  Tensor one = ones(Shape{1}, DType::i32);
  w.all_reduce_sum(one);
  CHECK(one.item<int32_t>() == w.size());
}

TEST_CASE("comm: an MPI error names the call, the rank, the host and MPI's text", "[comm][mpi]") {
  Communicator& w = world();
  Tensor t = zeros(Shape{4}, DType::f32);
  const int bad_root = w.size() + 3;
  std::string message = error_of([&] { w.broadcast(t, bad_root); });
  INFO(message);
  if (mpi_active()) {
    // Every rank's MPI rejects the root itself (MPI_ERRORS_RETURN), so no rank waits.
    CHECK_THAT(message, Catch::StartsWith("MPI_Bcast (root " + std::to_string(bad_root)) &&
                            Catch::Contains(fmt::format("failed on rank {} of {} in world", w.rank(), w.size())) &&
                            Catch::Contains("host " + w.host()) && Catch::Contains("MPI_ERR_ROOT"));
    std::unique_ptr<Communicator> sub = w.split(w.rank() % 2, 0);
    std::string sub_message = error_of([&] { sub->broadcast(t, bad_root); });
    CHECK_THAT(sub_message, Catch::Contains(fmt::format("rank {} of {} in world.split(color {})", sub->rank(),
                                                        sub->size(), w.rank() % 2)) &&
                                Catch::Contains(fmt::format("world rank {}", w.rank())));
  } else {
    CHECK_THAT(message, Catch::Contains("root " + std::to_string(bad_root)));
  }
  // The error left the communicator usable.
  Tensor one = ones(Shape{1}, DType::i64);
  w.all_reduce_sum(one);
  CHECK(one.item<int64_t>() == w.size());
}

// --- CUDA tensors: NCCL under MPI, device copies in one process -------------
//
// Each collective on CUDA tensors must give what the same collective gives on
// the same CPU tensors (bitwise: the values are small integers, so every sum is
// exact in any order and in bf16), with its result on the same GPU. bf16 sums,
// which the CPU path refuses, are checked against the f32 CPU sums.

namespace {

// Small integers (exact in bf16 and in every partial sum), varying with rank,
// element and a salt.
std::vector<double> small_ints(int r, int64_t count, int salt) {
  std::vector<double> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = (r + 1) * ((i + salt) % 7) - 3;
  return v;
}

void check_same(const Tensor& on_gpu, const Tensor& on_cpu, Device gpu) {
  CHECK(on_gpu.device() == gpu);
  CHECK(bitwise_equal(on_gpu.to(kCpu), on_cpu));
}

void check_cuda_collectives(Communicator& comm, Device gpu) {
  const int r = comm.rank(), n = comm.size();
  INFO("rank " << r << " of " << n << " on " << gpu.str());

  for (DType dt : {DType::f32, DType::f64, DType::i32, DType::i64}) {
    INFO("dtype " << dtype_name(dt));
    Tensor cpu = from_vector(small_ints(r, 33, 1), Shape{3, 11}, dt);
    Tensor cuda = cpu.to(gpu);
    comm.all_reduce_sum(cpu);
    comm.all_reduce_sum(cuda);
    check_same(cuda, cpu, gpu);

    Tensor whole = from_vector(small_ints(r, 2 * n * 5, 2), Shape{2 * n, 5}, dt);
    Tensor part_cuda = comm.reduce_scatter_sum(whole.to(gpu));  // collectives in one order on every rank
    check_same(part_cuda, comm.reduce_scatter_sum(whole), gpu);
  }
  {  // bf16 sums: NCCL only; against the f32 sums of the same values
    Tensor sum_f32 = from_vector(small_ints(r, 33, 3), Shape{33}, DType::f32);
    Tensor sum_bf16 = from_vector(small_ints(r, 33, 3), Shape{33}, DType::bf16).to(gpu);
    comm.all_reduce_sum(sum_f32);
    comm.all_reduce_sum(sum_bf16);
    CHECK(sum_bf16.device() == gpu);
    CHECK(sum_bf16.dtype() == DType::bf16);
    CHECK(sum_bf16.to_vector() == sum_f32.to_vector());

    std::vector<double> whole = small_ints(r, 2 * n * 4, 4);
    Tensor part_f32 = comm.reduce_scatter_sum(from_vector(whole, Shape{2 * n, 4}, DType::f32));
    Tensor part_bf16 = comm.reduce_scatter_sum(from_vector(whole, Shape{2 * n, 4}, DType::bf16).to(gpu));
    CHECK(part_bf16.shape() == Shape{2, 4});
    CHECK(part_bf16.to_vector() == part_f32.to_vector());
  }
  // An empty sum.
  Tensor none = empty(Shape{0, 3}, DType::f32, gpu);
  comm.all_reduce_sum(none);
  CHECK(none.numel() == 0);

  for (DType dt : {DType::f32, DType::i64, DType::bf16}) {
    INFO("dtype " << dtype_name(dt));
    Tensor mine = from_vector(small_ints(r, 12, 5), Shape{3, 2, 2}, dt);
    Tensor gathered_cuda = comm.all_gather(mine.to(gpu));
    check_same(gathered_cuda, comm.all_gather(mine), gpu);

    for (int root = 0; root < n; ++root) {
      INFO("root " << root);
      Tensor cpu = from_vector(small_ints(r, 5, root), Shape{5}, dt);
      Tensor cuda = cpu.to(gpu);
      comm.broadcast(cpu, root);
      comm.broadcast(cuda, root);
      check_same(cuda, cpu, gpu);
    }
  }
  CHECK(comm.all_gather(empty(Shape{0, 5}, DType::f32, gpu)).shape() == Shape{0, 5});

  // The variable-count forms (grouped ncclReduce / ncclBroadcast per rank),
  // rank 0 receiving none: as the CPU path.
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    counts.push_back(n > 1 && q == 0 ? 0 : q + 2);
    total += counts.back();
  }
  for (DType dt : {DType::f32, DType::f64}) {
    INFO("reduce_scatter_sum_v, dtype " << dtype_name(dt));
    Tensor whole = from_vector(small_ints(r, total, 6), Shape{total}, dt);
    Tensor part_cuda = comm.reduce_scatter_sum_v(whole.to(gpu), counts);
    check_same(part_cuda, comm.reduce_scatter_sum_v(whole, counts), gpu);
  }
  for (DType dt : {DType::f32, DType::i64, DType::bf16}) {
    INFO("all_gather_v, dtype " << dtype_name(dt));
    const int64_t c = counts[static_cast<size_t>(r)];
    Tensor mine = from_vector(small_ints(r, c, 7), Shape{c}, dt);
    Tensor gathered_cuda = comm.all_gather_v(mine.to(gpu), counts);
    check_same(gathered_cuda, comm.all_gather_v(mine, counts), gpu);
  }

  // all_to_all_v: uneven counts with empty pairs (rows_between), every row
  // stamped with source, destination, row and column.
  std::vector<int64_t> send_rows, recv_rows;
  for (int q = 0; q < n; ++q) {
    send_rows.push_back(rows_between(r, q));
    recv_rows.push_back(rows_between(q, r));
  }
  std::vector<double> stamps;
  for (int q = 0; q < n; ++q)
    for (int64_t j = 0; j < send_rows[static_cast<size_t>(q)]; ++j)
      for (int64_t c = 0; c < 6; ++c) stamps.push_back(stamp(r, q, j, c));  // bf16: rounded, then moved as bytes
  const int64_t num_send = static_cast<int64_t>(stamps.size()) / 6;
  for (DType dt : {DType::f32, DType::i64, DType::bf16}) {
    INFO("all_to_all_v, dtype " << dtype_name(dt));
    Tensor send = from_vector(stamps, Shape{num_send, 2, 3}, dt);
    Tensor out_cuda = comm.all_to_all_v(send.to(gpu), send_rows, recv_rows);
    check_same(out_cuda, comm.all_to_all_v(send, send_rows, recv_rows), gpu);
  }
  std::vector<int64_t> zero(static_cast<size_t>(n), 0);
  CHECK(comm.all_to_all_v(empty(Shape{0, 4}, DType::f32, gpu), zero, zero).shape() == Shape{0, 4});
  std::vector<int64_t> to_first(static_cast<size_t>(n), 0), from_all(static_cast<size_t>(n), 0);
  to_first[0] = 2;
  if (r == 0) from_all.assign(static_cast<size_t>(n), 2);
  Tensor gathered = full(Shape{2, 1}, r, DType::f64);
  Tensor gathered_cuda = comm.all_to_all_v(gathered.to(gpu), to_first, from_all);
  check_same(gathered_cuda, comm.all_to_all_v(gathered, to_first, from_all), gpu);

  // Past the small-message paths: 1 MiB sums, 12 KB rows.
  Tensor big = empty(Shape{1 << 18}, DType::f32);
  for (int64_t i = 0; i < big.numel(); ++i) big.data<float>()[i] = static_cast<float>((r + 1) * (i % 7));
  Tensor big_cuda = big.to(gpu);
  comm.all_reduce_sum(big);
  comm.all_reduce_sum(big_cuda);
  check_same(big_cuda, big, gpu);
  std::vector<int64_t> many_send, many_recv;
  for (int q = 0; q < n; ++q) many_send.push_back(r + q + 1), many_recv.push_back(q + r + 1);
  int64_t num_many = 0;
  for (int64_t k : many_send) num_many += k;
  Tensor rows = from_vector(small_ints(r, num_many * 3000, 6), Shape{num_many, 3000}, DType::f32);
  Tensor rows_cuda = comm.all_to_all_v(rows.to(gpu), many_send, many_recv);
  check_same(rows_cuda, comm.all_to_all_v(rows, many_send, many_recv), gpu);

  // Sums refuse what they cannot add, on either device, before communicating.
  Tensor bytes = zeros(Shape{4}, DType::u16, gpu);
  CHECK_THAT(error_of([&] { comm.all_reduce_sum(bytes); }),
             Catch::Contains("all_reduce_sum") && Catch::Contains("u16"));
}

// This rank's GPU: ranks of one node take one GPU each (as the trainer does
// by local rank). False, with a note, when the node has fewer GPUs than ranks:
// NCCL refuses two ranks of one communicator on one GPU.
bool gpu_per_rank(const Communicator& w) {
  if (!gpu_available()) return false;
  if (cuda::device_count() >= w.size()) return true;
  if (w.rank() == 0)
    fmt::print(stderr, "[comm][cuda][mpi] skipped: {} ranks but {} GPU(s); NCCL needs one GPU per rank\n", w.size(),
               cuda::device_count());
  return false;
}

}  // namespace

TEST_CASE("comm: the one-process communicator takes CUDA tensors", "[comm][cuda]") {
  if (!gpu_available()) return;
  std::unique_ptr<Communicator> one = single_process();
  check_cuda_collectives(*one, Device{DeviceKind::cuda, 0});
}

TEST_CASE("comm: CUDA tensors through the world and split groups match the CPU path", "[comm][cuda][mpi]") {
  if (!gpu_available()) return;
  Communicator& w = world();
  if (!gpu_per_rank(w)) return;  // the same answer on every rank of a node
  const Device gpu{DeviceKind::cuda, w.rank()};
  check_cuda_collectives(w, gpu);
  // Groups with their own NCCL communicators on the same GPUs.
  std::unique_ptr<Communicator> pairs = w.split(w.rank() / 2, w.rank());
  REQUIRE(pairs != nullptr);
  check_cuda_collectives(*pairs, gpu);
  std::unique_ptr<Communicator> reversed = w.split(0, w.size() - w.rank());
  REQUIRE(reversed != nullptr);
  check_cuda_collectives(*reversed, gpu);
  // The world again, after the groups: its NCCL communicator is still usable.
  Tensor one = ones(Shape{3}, DType::i32, gpu);
  w.all_reduce_sum(one);
  CHECK(one.to_vector() == std::vector<double>(3, w.size()));
}
