// Differentiable collectives: the backward of all_to_all_v is the exchange with
// the counts swapped, the backward of all_gather is a reduce-scatter; both pass
// a float64 finite-difference check of the loss summed over all ranks.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>

#include "comm/collectives.h"
#include "comm/communicator.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using namespace moetrain::comm;

namespace {

int64_t rows_between(int src, int dst) { return (2 * src + dst + 1) % 3; }

// Finite differences of the global loss L = sum over ranks of <w_rank, fn(x_rank)>:
// each element of each rank's x is perturbed in turn (only on its rank), every
// rank evaluates its term, and an all_reduce_sum gives the change of L. The
// analytic gradient is x.grad after backward with upstream w on every rank.
double max_rel_error_across_ranks(Communicator& comm, const std::function<Tensor(const Tensor&)>& fn,
                                  const Tensor& x_in, double eps = 1e-6) {
  REQUIRE(x_in.dtype() == DType::f64);
  Tensor x = x_in.clone();
  x.set_requires_grad(true);
  Tensor y = fn(x);
  Tensor w = randn(y.shape(), DType::f64, 100 + static_cast<uint64_t>(comm.rank()));
  y.backward(w);
  std::vector<double> analytic =
      x.grad().defined() ? x.grad().to_vector() : std::vector<double>(static_cast<size_t>(x.numel()), 0.0);

  NoGradGuard no_grad;
  auto local_loss = [&](const Tensor& xv) {
    std::vector<double> yv = fn(xv).to_vector(), wv = w.to_vector();
    double s = 0;
    for (size_t i = 0; i < yv.size(); ++i) s += wv[i] * yv[i];
    return s;
  };
  Tensor counts = comm.all_gather(from_vector({static_cast<double>(x.numel())}, Shape{1}, DType::i64));
  Tensor probe = x.detach().clone();
  double* p = probe.data<double>();
  double worst = 0;
  for (int q = 0; q < comm.size(); ++q) {
    const int64_t n = static_cast<int64_t>(counts.to_vector()[static_cast<size_t>(q)]);
    for (int64_t e = 0; e < n; ++e) {
      const bool mine = q == comm.rank();
      const double orig = mine ? p[e] : 0;
      if (mine) p[e] = orig + eps;
      double up = local_loss(probe);
      if (mine) p[e] = orig - eps;
      double down = local_loss(probe);
      if (mine) p[e] = orig;
      Tensor diff = from_vector({up - down}, Shape{1}, DType::f64);
      comm.all_reduce_sum(diff);
      if (!mine) continue;
      const double numeric = diff.item<double>() / (2 * eps), an = analytic[static_cast<size_t>(e)];
      worst = std::max(worst, std::abs(an - numeric) / std::max({std::abs(an), std::abs(numeric), 1e-3}));
    }
  }
  return worst;
}

void check_all_to_all_v_backward(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  std::vector<int64_t> send_rows, recv_rows;
  for (int q = 0; q < n; ++q) {
    send_rows.push_back(rows_between(r, q));
    recv_rows.push_back(rows_between(q, r));
  }
  int64_t num_send = 0, num_recv = 0;
  for (int q = 0; q < n; ++q) num_send += send_rows[static_cast<size_t>(q)], num_recv += recv_rows[static_cast<size_t>(q)];
  const int64_t cols = 3;

  Tensor x = randn(Shape{num_send, cols}, DType::f64, 7 + static_cast<uint64_t>(r));
  x.set_requires_grad(true);
  Tensor y = comm::all_to_all_v(comm, x, send_rows, recv_rows);
  CHECK(y.shape() == Shape{num_recv, cols});
  CHECK(y.requires_grad());
  // Upstream gradient on rank d, row i, column c: d * 1000 + i * 10 + c + 0.5.
  auto grad_at = [](int d, int64_t i, int64_t c) { return d * 1000.0 + i * 10.0 + c + 0.5; };
  std::vector<double> g;
  for (int64_t i = 0; i < num_recv; ++i)
    for (int64_t c = 0; c < cols; ++c) g.push_back(grad_at(r, i, c));
  y.backward(from_vector(g, y.shape(), DType::f64));

  // Row k of the block this rank sent to d sits on d after the rows of the
  // lower ranks: at sum_{s < r} rows_between(s, d) + k.
  REQUIRE(x.grad().defined());
  std::vector<double> got = x.grad().to_vector();
  int64_t row = 0;
  for (int d = 0; d < n; ++d) {
    int64_t offset = 0;
    for (int s = 0; s < r; ++s) offset += rows_between(s, d);
    for (int64_t k = 0; k < send_rows[static_cast<size_t>(d)]; ++k, ++row)
      for (int64_t c = 0; c < cols; ++c) {
        INFO("row " << row << " (to rank " << d << ") column " << c);
        CHECK(got[static_cast<size_t>(row * cols + c)] == grad_at(d, offset + k, c));
      }
  }

  // Composed with local ops on both sides, against finite differences.
  auto fn = [&](const Tensor& in) {
    Tensor moved = comm::all_to_all_v(comm, square(in), send_rows, recv_rows);
    return comm::all_to_all_v(comm, tanh(moved), recv_rows, send_rows) * in;
  };
  CHECK(max_rel_error_across_ranks(comm, fn, randn(Shape{num_send, cols}, DType::f64, 11 + static_cast<uint64_t>(r))) <
        1e-6);
}

void check_all_gather_backward(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  Tensor x = randn(Shape{2, 3}, DType::f64, 21 + static_cast<uint64_t>(r));
  x.set_requires_grad(true);
  Tensor y = comm::all_gather(comm, x);
  CHECK(y.shape() == Shape{2 * n, 3});
  // Upstream on rank d: (d + 1) * (flat index + 1); grad_x sums block r over d.
  std::vector<double> g;
  for (int64_t i = 0; i < 2 * n * 3; ++i) g.push_back((r + 1) * static_cast<double>(i + 1));
  y.backward(from_vector(g, y.shape(), DType::f64));
  REQUIRE(x.grad().defined());
  std::vector<double> got = x.grad().to_vector();
  for (int64_t i = 0; i < 6; ++i) {
    double expected = 0;
    for (int d = 0; d < n; ++d) expected += (d + 1) * static_cast<double>(r * 6 + i + 1);
    CHECK(got[static_cast<size_t>(i)] == expected);
  }
  auto fn = [&](const Tensor& in) { return sigmoid(comm::all_gather(comm, in * in)); };
  CHECK(max_rel_error_across_ranks(comm, fn, randn(Shape{2, 3}, DType::f64, 31 + static_cast<uint64_t>(r))) < 1e-6);
}

}  // namespace

TEST_CASE("comm: all_to_all_v backward is the swapped exchange (one process)", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_all_to_all_v_backward(*one);
}

TEST_CASE("comm: all_gather backward is a reduce-scatter (one process)", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_all_gather_backward(*one);
}

TEST_CASE("comm: all_to_all_v backward is the swapped exchange", "[comm][mpi]") { check_all_to_all_v_backward(world()); }

TEST_CASE("comm: all_gather backward is a reduce-scatter", "[comm][mpi]") { check_all_gather_backward(world()); }

TEST_CASE("comm: collectives record nothing without grad", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  Tensor x = ones(Shape{2, 2}, DType::f32);
  CHECK(!comm::all_to_all_v(*one, x, {2}, {2}).requires_grad());
  Tensor ids = arange(4, DType::i64).reshape({4, 1});  // integer payloads travel too
  CHECK(comm::all_to_all_v(*one, ids, {4}, {4}).to_vector() == std::vector<double>{0, 1, 2, 3});
  CHECK(!comm::all_gather(*one, x).requires_grad());
}
