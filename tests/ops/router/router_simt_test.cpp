// The CUDA router selection body (ops/router/router_simt.h), run on the host block by
// block (simt::HostBlock), against the CPU's select_experts (ops/router/router_cpu.cpp): plain
// and group-limited top-k, ties, NaN, a bias, block sizes from one thread to the
// kernel's 128. The [cuda] case runs the kernel itself (skipped without a GPU).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "moetrain.h"
#include "nn/moe.h"
#include "ops/router/router_simt.h"
#include "ops/simt_orders.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;

namespace {

struct RouterShape {
  int64_t N, E, k, n_group, topk_group;
};

// Scores with ties (rounded to 1/4) and a NaN in some rows, a bias of the same size.
Tensor make_scores(const RouterShape& r, DType dt, uint64_t seed) {
  std::vector<double> v = randn({r.N, r.E}, DType::f64, seed).to_vector();
  for (double& x : v) x = std::round(x * 4) / 4;
  for (int64_t n = 0; n < r.N; n += 3) v[static_cast<size_t>(n * r.E + (n * 7) % r.E)] = std::nan("");
  return from_vector(v, {r.N, r.E}, DType::f64).to(dt);
}

Tensor make_bias(const RouterShape& r, uint64_t seed) {
  std::vector<double> b = randn({r.E}, DType::f64, seed).to_vector();
  for (double& x : b) x = std::round(x * 8) / 16;
  return from_vector(b, {r.E}, DType::f64).to(DType::f32);
}

template <class T>
std::vector<int64_t> run_body(const Tensor& scores, const Tensor& bias, const RouterShape& r, int threads,
                              simt::HostOrder order) {
  const Tensor bias64 = bias.to(DType::f64);
  std::vector<int64_t> out(static_cast<size_t>(r.N * r.k), -7);
  simt::ExpertSelectArgs<T> a;
  a.scores = scores.data<T>();
  a.bias = bias64.data<double>();
  a.experts = out.data();
  a.N = r.N;
  a.E = r.E;
  a.k = r.k;
  a.n_group = r.n_group;
  a.topk_group = r.topk_group;
  std::vector<double> sh(static_cast<size_t>(simt::expert_select_shared_elements(r.E, r.n_group, threads)));
  const simt::HostBlock blk = testing::host_block(threads, order);
  for (int64_t row = 0; row < r.N; ++row) simt::expert_select_row(blk, a, row, sh.data());
  return out;
}

const RouterShape kRoutings[] = {
    {9, 33, 4, 1, 1},    // plain top-k, E off the block sizes
    {7, 64, 6, 8, 3},    // group-limited (DeepSeek-V3 style: 8 groups, 3 kept)
    {5, 12, 3, 3, 2},    // small groups
    {6, 8, 2, 8, 4},     // groups of one expert (their score is the expert's)
    {4, 5, 5, 1, 1},     // k = E
    {3, 300, 16, 4, 4},  // every group kept, k = 16 of 300
};

}  // namespace

TEST_CASE("router: the CUDA selection body, run on the host, picks what select_experts picks",
          "[ops][router][simt]") {
  for (const RouterShape& r : kRoutings)
    for (int threads : {1, 8, 32, 128})
      DYNAMIC_SECTION("N" << r.N << " E" << r.E << " k" << r.k << " groups " << r.n_group << "/" << r.topk_group
                          << " threads " << threads) {
        const Tensor bias = make_bias(r, 5);
        for (DType dt : {DType::f32, DType::f64}) {
          const Tensor scores = make_scores(r, dt, 3);
          const std::vector<int64_t> want = select_experts(scores, bias, r.k, r.n_group, r.topk_group);
          const std::vector<int64_t> got = testing::run_in_all_orders([&](simt::HostOrder o) {
            return dt == DType::f32 ? run_body<float>(scores, bias, r, threads, o)
                                    : run_body<double>(scores, bias, r, threads, o);
          });
          CHECK(got == want);
        }
      }
}

TEST_CASE("router: select_experts ranks NaN first, then larger, ties by the lower index (groups too)",
          "[ops][router]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Group scores: {1+1, 2+0, nan+0}: the NaN group first, then the tie 2 = 2 by the lower group.
  Tensor s = from_vector({1, 1, 2, 0, nan, 0}, {1, 6}, DType::f32);
  CHECK(select_experts(s, zeros({6}, DType::f32), 3, 3, 2) == std::vector<int64_t>{4, 0, 1});
  Tensor t = from_vector({0.5, nan, 0.5, 1}, {1, 4}, DType::f32);
  CHECK(select_experts(t, zeros({4}, DType::f32), 4) == std::vector<int64_t>{1, 3, 0, 2});
}

TEST_CASE("router: CUDA select_experts picks what the CPU picks", "[ops][router][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (const RouterShape& r : kRoutings)
    for (DType dt : {DType::f32, DType::bf16, DType::f64})
      DYNAMIC_SECTION("N" << r.N << " E" << r.E << " k" << r.k << " " << fmt::format("{}", dt)) {
        const Tensor bias = make_bias(r, 5), scores = make_scores(r, dt, 3);
        const std::vector<int64_t> want = select_experts(scores, bias, r.k, r.n_group, r.topk_group);
        CHECK(select_experts(cuda_twin(scores, dt), cuda_twin(bias, DType::f32), r.k, r.n_group, r.topk_group) ==
              want);
      }
}
