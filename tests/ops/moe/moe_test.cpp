// grouped_linear (ops/moe/moe.h): one GEMM per expert over its rows.
#include <catch2/catch.hpp>

#include <numeric>

#include "moetrain.h"
#include "ops/moe/moe.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/cublas.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::rel_error;

TEST_CASE("grouped_linear: each row uses its expert's matrix; empty experts work", "[ops][moe]") {
  // Experts 1 and 3 get no rows; expert 4 the last three.
  const std::vector<int64_t> counts = {2, 0, 4, 0, 3};
  const int64_t M = 9, in = 5, out = 3, E = 5;
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor x = randn({M, in}, dt, 1), w = randn({E, out, in}, dt, 2);
    std::vector<double> y = grouped_linear(x, w, counts).to_vector();
    std::vector<double> xv = x.to_vector(), wv = w.to_vector();
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < counts[e]; ++r, ++row)
        for (int64_t o = 0; o < out; ++o) {
          double ref = 0;
          for (int64_t i = 0; i < in; ++i) ref += xv[row * in + i] * wv[(e * out + o) * in + i];
          CHECK(y[row * out + o] == Approx(ref).epsilon(dt == DType::f64 ? 1e-13 : 1e-5).margin(1e-6));
        }
  }
  // No rows at all.
  Tensor y0 = grouped_linear(empty({0, in}, DType::f64), randn({E, out, in}, DType::f64, 3), {0, 0, 0, 0, 0});
  CHECK(y0.shape() == Shape{0, out});
}

TEST_CASE("grouped_linear: gradients match finite differences (zero-row experts get zero gradient)", "[ops][moe]") {
  const std::vector<int64_t> counts = {3, 0, 1, 4};
  Tensor x = randn({8, 6}, DType::f64, 4), w = randn({4, 5, 6}, DType::f64, 5);
  check_gradients([&](const Tensors& in) { return grouped_linear(in[0], in[1], counts); }, {x, w});
  Tensor wl = randn({4, 5, 6}, DType::f64, 6);
  wl.set_requires_grad(true);
  sum(grouped_linear(x, wl, counts)).backward();
  std::vector<double> g = wl.grad().to_vector();
  for (int64_t i = 30; i < 60; ++i) CHECK(g[i] == 0.0);  // expert 1
}

namespace {

struct GroupedRun {
  Tensor y, dx, dw;
};

GroupedRun run_grouped(const Tensor& x0, const Tensor& w0, const Tensor& dy, const std::vector<int64_t>& counts) {
  Tensor x = x0.clone().set_requires_grad(), w = w0.clone().set_requires_grad();
  Tensor y = grouped_linear(x, w, counts);
  autograd::backward({y}, {dy});
  return {y, x.grad(), w.grad()};
}

// y, dx and dw by the definition, in double: y_e = x_e w_e^T, dx_e = dy_e w_e, dw_e = dy_e^T x_e.
GroupedRun reference_grouped(const Tensor& x, const Tensor& w, const Tensor& dy, const std::vector<int64_t>& counts) {
  const int64_t M = x.size(0), in = x.size(1), out = w.size(1);
  std::vector<double> xv = x.to_vector(), wv = w.to_vector(), dyv = dy.to_vector();
  std::vector<double> y(M * out, 0.0), dx(M * in, 0.0), dw(wv.size(), 0.0);
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e)
    for (int64_t r = 0; r < counts[e]; ++r, ++row)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const double we = wv[(e * out + o) * in + i];
          y[row * out + o] += xv[row * in + i] * we;
          dx[row * in + i] += dyv[row * out + o] * we;
          dw[(e * out + o) * in + i] += dyv[row * out + o] * xv[row * in + i];
        }
  return {from_vector(y, {M, out}, DType::f64), from_vector(dx, {M, in}, DType::f64), from_vector(dw, w.shape(), DType::f64)};
}

}  // namespace

TEST_CASE("grouped_linear: small and large experts match the definition in every vector copy; same bits at 1-3 threads and in both FMA copies",
          "[ops][moe]") {
  // Small experts (k3-small's widths, and widths that are not a multiple of a vector)
  // take the tile GEMM spread over the threads; large ones one threaded GEMM each
  // (ops/moe/moe_cpu.cpp). Empty experts and uneven counts included.
  struct Case {
    int64_t in, out;
    std::vector<int64_t> counts;
  };
  const std::vector<Case> cases = {
      {128, 112, {17, 0, 40, 3, 1, 0, 29, 12, 8, 33, 0, 5, 21, 2, 9, 14}},
      {48, 40, {6, 0, 1, 11, 7, 0, 2, 5, 13, 4}},
      {24, 8, {3, 1, 0, 2, 5, 1}},
      {256, 320, {70, 0, 90}},  // ~6-7M multiply-adds per expert: the large path
  };
  const std::vector<cpu::VectorIsa> isas = moetrain::testing::runnable_isas();
  const int threads_before = cpu::num_threads();
  for (const Case& c : cases) {
    const int64_t M = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
    const int64_t E = static_cast<int64_t>(c.counts.size());
    Tensor x = randn({M, c.in}, DType::f32, 11), w = randn({E, c.out, c.in}, DType::f32, 12);
    Tensor dy = randn({M, c.out}, DType::f32, 13);
    GroupedRun ref = reference_grouped(x, w, dy, c.counts);
    std::vector<GroupedRun> fma_copies;  // the AVX2 and AVX-512 copies: the same FMAs per element
    for (cpu::VectorIsa isa : isas) {
      cpu::cap_vector_isa_for_testing(isa);
      INFO("in " << c.in << " out " << c.out << ", copy " << cpu::vector_isa_name(isa));
      cpu::set_num_threads(1);
      GroupedRun one = run_grouped(x, w, dy, c.counts);
      CHECK(rel_error(one.y.to(DType::f64), ref.y) < 1e-5);
      CHECK(rel_error(one.dx.to(DType::f64), ref.dx) < 1e-5);
      CHECK(rel_error(one.dw.to(DType::f64), ref.dw) < 1e-5);
      if (isa != cpu::VectorIsa::generic) fma_copies.push_back(one);
      for (int threads : {2, 3}) {
        cpu::set_num_threads(threads);
        GroupedRun many = run_grouped(x, w, dy, c.counts);
        INFO(threads << " threads");
        CHECK(moetrain::testing::bitwise_equal(many.y, one.y));
        CHECK(moetrain::testing::bitwise_equal(many.dx, one.dx));
        CHECK(moetrain::testing::bitwise_equal(many.dw, one.dw));
      }
    }
    if (fma_copies.size() == 2) {
      INFO("in " << c.in << " out " << c.out << ": AVX2 vs AVX-512 copy");
      CHECK(moetrain::testing::bitwise_equal(fma_copies[0].y, fma_copies[1].y));
      CHECK(moetrain::testing::bitwise_equal(fma_copies[0].dx, fma_copies[1].dx));
      CHECK(moetrain::testing::bitwise_equal(fma_copies[0].dw, fma_copies[1].dw));
    }
  }
  cpu::cap_vector_isa_for_testing(std::nullopt);
  cpu::set_num_threads(threads_before);
}

TEST_CASE("grouped_linear: bad shapes are named", "[ops][moe]") {
  Tensor x = randn({4, 3}, DType::f64, 1), w = randn({2, 5, 3}, DType::f64, 2);
  CHECK_THROWS_WITH(grouped_linear(x, w, {1, 2}), Catch::Contains("row counts sum to 3") && Catch::Contains("[4, 3]"));
  CHECK_THROWS_WITH(grouped_linear(x, w, {4}), Catch::Contains("1 row counts for w [2, 5, 3]"));
  CHECK_THROWS_WITH(grouped_linear(x, randn({2, 5, 4}, DType::f64, 3), {2, 2}), Catch::Contains("w must be [E, out, 3]"));
}

TEST_CASE("grouped_linear: CUDA matches CPU, experts without rows included", "[ops][moe][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  std::vector<int64_t> counts = {5, 0, 33, 1, 0, 17};
  Tensor x = randn({56, 65}, DType::f32, 1).set_requires_grad();
  Tensor w = randn({6, 31, 65}, DType::f32, 2).set_requires_grad();
  auto fn = [counts](const Tensors& in) { return Tensors{grouped_linear(in[0], in[1], counts)}; };
  for (DType dtype : {DType::f32, DType::f64, DType::bf16})  // f32, bf16: one grouped call; f64: a GEMM per expert
    moetrain::testing::check_cuda_matches_cpu(fn, {x, w}, {true, true}, dtype, moetrain::testing::tolerance_for(dtype));
  // TF32 products (10-bit mantissas) through the grouped call, or its per-expert fallback.
  cuda::set_allow_tf32(true);
  moetrain::testing::check_cuda_matches_cpu(fn, {x, w}, {true, true}, DType::f32, {5e-3, 5e-3});
  cuda::set_allow_tf32(false);
}

namespace {
// The composition the op replaces: gather (a zero row for dropped slots), weight, sum over slots.
Tensor combine_by_definition(const Tensor& rows, const std::vector<int64_t>& slot_rows, const Tensor& weights) {
  const int64_t N = weights.size(0), k = weights.size(1), W = rows.size(1);
  Tensor padded = concat({rows, zeros({1, W}, rows.dtype())}, 0);
  Tensor slots = reshape(index_select(padded, 0, slot_rows), {N, k, W});
  return sum(mul(slots, reshape(weights, {N, k, 1})), 1);
}

// 5 tokens x top 3 over 12 rows; row 12 means dropped: slots (1, 2) and (3, 0), and all
// of token 4. Rows 4 and 9 are named by no slot (they get zero gradient), every other
// row by one slot, as MoeLayer's plan makes them.
std::vector<int64_t> combine_slots() { return {3, 0, 7, 10, 1, 12, 5, 2, 8, 12, 6, 11, 12, 12, 12}; }
}  // namespace

TEST_CASE("moe_combine: equals gather, weight and sum over slots; dropped slots add nothing", "[ops][moe]") {
  const std::vector<int64_t> slots = combine_slots();
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor rows = randn({12, 7}, dt, 21), weights = randn({5, 3}, dt, 22);
    Tensor y = moe_combine(rows, slots, weights);
    REQUIRE(y.shape() == Shape{5, 7});
    CHECK(moetrain::testing::max_abs_diff(y.to(DType::f64), combine_by_definition(rows, slots, weights).to(DType::f64)) <
          (dt == DType::f64 ? 1e-14 : 1e-5));
    std::vector<double> yv = y.to_vector();
    for (int64_t c = 0; c < 7; ++c) CHECK(yv[4 * 7 + c] == 0.0);  // token 4: every slot dropped
  }
}

TEST_CASE("moe_combine: gradients match finite differences; rows no slot names get zero", "[ops][moe]") {
  const std::vector<int64_t> slots = combine_slots();
  Tensor rows = randn({12, 7}, DType::f64, 23), weights = randn({5, 3}, DType::f64, 24);
  check_gradients([&](const Tensors& in) { return moe_combine(in[0], slots, in[1]); }, {rows, weights});
  Tensor r = rows.clone().set_requires_grad(), w = weights.clone().set_requires_grad();
  sum(moe_combine(r, slots, w)).backward();
  std::vector<double> gr = r.grad().to_vector(), gw = w.grad().to_vector();
  for (int64_t row : {4, 9})
    for (int64_t c = 0; c < 7; ++c) CHECK(gr[row * 7 + c] == 0.0);
  CHECK(gw[1 * 3 + 2] == 0.0);  // a dropped slot's weight gets zero
}

TEST_CASE("moe_combine: bad slot rows are named", "[ops][moe]") {
  Tensor rows = randn({4, 3}, DType::f64, 1), weights = randn({2, 2}, DType::f64, 2);
  CHECK_THROWS_WITH(moe_combine(rows, {0, 1, 2}, weights), Catch::Contains("3 slot rows for weights [2, 2]"));
  CHECK_THROWS_WITH(moe_combine(rows, {0, 1, 2, 5}, weights), Catch::Contains("slot row 5 outside [0, 4]"));
  CHECK_THROWS_WITH(moe_combine(rows, {0, 1, 1, 4}, weights), Catch::Contains("row 1 is named by two slots"));
  CHECK_THROWS_WITH(moe_combine(rows, {0, 1, 2, 3}, randn({2, 2}, DType::f32, 3)), Catch::Contains("moe_combine"));
}

TEST_CASE("moe_combine: CUDA matches CPU, dropped slots included", "[ops][moe][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  const std::vector<int64_t> slots = combine_slots();
  Tensor rows = randn({12, 67}, DType::f32, 31).set_requires_grad();
  Tensor weights = randn({5, 3}, DType::f32, 32).set_requires_grad();
  auto fn = [slots](const Tensors& in) { return Tensors{moe_combine(in[0], slots, in[1])}; };
  for (DType dtype : {DType::f32, DType::f64, DType::bf16})
    moetrain::testing::check_cuda_matches_cpu(fn, {rows, weights}, {true, true}, dtype,
                                              moetrain::testing::tolerance_for(dtype));
}
