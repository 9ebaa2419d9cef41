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

TEST_CASE("gather_last: reads each row at its indices, any rank, repeated indices included", "[ops][topk][gather]") {
  Tensor x = randn({2, 3, 7}, DType::f64, 4);
  const std::vector<double> idx = {6, 0, 0, 3, 2, 2, 5, 1, 4, 4, 4, 0, 1, 2, 3, 6, 5, 0};  // [2, 3, 3]
  Tensor index = from_vector(idx, {2, 3, 3}, DType::i64);
  Tensor out = gather_last(x, index);
  REQUIRE(out.shape() == Shape{2, 3, 3});
  const std::vector<double> vx = x.to_vector(), vo = out.to_vector();
  for (int r = 0; r < 6; ++r)
    for (int j = 0; j < 3; ++j) CHECK(vo[r * 3 + j] == vx[r * 7 + static_cast<int>(idx[r * 3 + j])]);
}

TEST_CASE("gather_last: the gradient adds back at the indices (finite differences, repeats summed)",
          "[ops][topk][gather]") {
  Tensor x = randn({4, 9}, DType::f64, 5);
  Tensor index = from_vector({8, 1, 1, 0, 3, 4, 7, 2, 2, 2, 5, 5}, {4, 3}, DType::i64);
  check_gradients([index](const Tensors& in) { return gather_last(in[0], index); }, {x});
  // Repeats: the row's gradient at a twice-read entry is the sum of both reads'.
  Tensor xr = randn({1, 4}, DType::f64, 6).set_requires_grad();
  gather_last(xr, from_vector({2, 2, 0}, {1, 3}, DType::i64)).backward(from_vector({1.5, 0.25, -1}, {1, 3},
                                                                                   DType::f64));
  CHECK(xr.grad().to_vector() == std::vector<double>{-1, 0, 1.75, 0});
}

TEST_CASE("gather_last: bad indices and shapes are reported", "[ops][topk][gather][errors]") {
  Tensor x = randn({2, 5}, DType::f32, 1);
  CHECK_THROWS_WITH(gather_last(x, from_vector({0, 5}, {2, 1}, DType::i64)),
                    Catch::Contains("index 5 at position 1") && Catch::Contains("outside [0, 5)"));
  CHECK_THROWS_WITH(gather_last(x, from_vector({0, -1}, {2, 1}, DType::i64)), Catch::Contains("index -1"));
  CHECK_THROWS_WITH(gather_last(x, from_vector({0, 1}, {2, 1}, DType::i32)), Catch::Contains("must be i64"));
  CHECK_THROWS_WITH(gather_last(x, from_vector({0, 1, 2}, {3, 1}, DType::i64)),
                    Catch::Contains("must be x's shape [2, 5] but for the last dim"));
}

TEST_CASE("gather_last: CUDA matches CPU (values, gradient with repeats); outside indices read NaN",
          "[ops][topk][gather][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    Tensor x = randn({33, 70}, DType::f64, 8);
    Generator gen(9);
    Tensor index = randint({33, 16}, 70, DType::i64, gen);  // repeats within rows happen
    check_cuda_matches_cpu([index](const Tensors& in) { return gather_last(in[0], index.to(in[0].device())); },
                           {x}, {true}, dt, tolerance_for(dt));
  }
  Tensor bad = from_vector({0, 70, -3}, {1, 3}, DType::i64).to(kCuda);
  const std::vector<double> v = gather_last(randn({1, 70}, DType::f32, 1).to(kCuda), bad).to(kCpu).to_vector();
  CHECK(!std::isnan(v[0]));
  CHECK(std::isnan(v[1]));
  CHECK(std::isnan(v[2]));
}
