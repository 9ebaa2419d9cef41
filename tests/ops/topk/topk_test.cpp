#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "moetrain.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

TEST_CASE("topk: values descending, indices point at them, ties take the lower index", "[ops][topk]") {
  Tensor x = randn({4, 33}, DType::f64, 1);
  TopK r = topk(x, 5);
  std::vector<double> vx = x.to_vector(), vv = r.values.to_vector(), vi = r.indices.to_vector();
  for (int row = 0; row < 4; ++row) {
    std::vector<double> sorted(vx.begin() + row * 33, vx.begin() + (row + 1) * 33);
    std::sort(sorted.rbegin(), sorted.rend());
    for (int j = 0; j < 5; ++j) {
      REQUIRE(vv[row * 5 + j] == sorted[j]);
      REQUIRE(vx[row * 33 + static_cast<int>(vi[row * 5 + j])] == sorted[j]);
    }
  }
  TopK tie = topk(from_vector({1, 3, 3, 2, 3}, {5}, DType::f32), 3);
  CHECK(tie.indices.to_vector() == std::vector<double>{1, 2, 4});
}

TEST_CASE("topk: gradient flows to the selected entries only", "[ops][topk]") {
  Tensor x = randn({3, 31}, DType::f64, 2);  // distinct values: the selection is stable under eps
  check_gradients([](const Tensors& in) { return topk(in[0], 4).values; }, {x});
}

TEST_CASE("topk: k out of range is reported", "[ops][topk][errors]") {
  CHECK_THROWS_WITH(topk(randn({2, 5}, DType::f32, 1), 6), Catch::Contains("topk") && Catch::Contains("k = 6"));
  CHECK_THROWS_WITH(topk(randn({2, 5}, DType::f32, 1), 0), Catch::Contains("k = 0"));
}

TEST_CASE("topk: CUDA matches CPU (values, indices, gradient), ties and NaN included", "[ops][topk][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t n : {1, 31, 33, 257, 4099})
      for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{8}, n}) {
        if (k > n || (k == n && (n == 1 || n > 300))) continue;  // k = n once, for the smaller rows
        DYNAMIC_SECTION(fmt::format("{} n={} k={}", dt, n, k)) {
          std::vector<double> v = randn({6, n}, DType::f64, static_cast<uint64_t>(n * 10 + k)).to_vector();
          for (double& e : v) e = std::round(e * 2) / 2;  // ties, broken by the lower index
          v[static_cast<size_t>(n / 2)] = std::numeric_limits<double>::quiet_NaN();  // NaN ranks first
          Tensor x = from_vector(v, {6, n}, DType::f64);
          check_cuda_matches_cpu([k](const Tensors& in) { return topk(in[0], k).values; }, {x}, {true}, dt,
                                 tolerance_for(dt));
          Tensor ic = topk(cpu_twin(x, dt), k).indices, ig = topk(cuda_twin(x, dt), k).indices;
          REQUIRE(ig.is_cuda());
          CHECK(moetrain::testing::bitwise_equal(ig.to(kCpu), ic));
        }
      }
}
