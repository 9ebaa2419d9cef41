#include <catch2/catch.hpp>

#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

TEST_CASE("embedding: gathers rows; repeated ids accumulate in backward", "[ops][embedding]") {
  Tensor table = randn({11, 33}, DType::f64, 1);
  Tensor ids = from_vector({3, 0, 3, 10, 3, 7}, {2, 3}, DType::i64);
  Tensor y = embedding(table, ids);
  REQUIRE(y.shape() == Shape{2, 3, 33});
  std::vector<double> vt = table.to_vector(), vy = y.to_vector();
  std::vector<int> id = {3, 0, 3, 10, 3, 7};
  for (int p = 0; p < 6; ++p)
    for (int j = 0; j < 33; ++j) REQUIRE(vy[p * 33 + j] == vt[id[p] * 33 + j]);
  check_gradients([&](const Tensors& in) { return embedding(in[0], ids); }, {table});
  Tensor u16 = from_vector({3, 0, 3, 10, 3, 7}, {6}, DType::u16);
  CHECK(moetrain::testing::bitwise_equal(embedding(table, u16), reshape(y, {6, 33})));
}

TEST_CASE("embedding: out-of-range ids name the id and the table", "[ops][embedding][errors]") {
  Tensor table = randn({11, 4}, DType::f32, 1);
  CHECK_THROWS_WITH(embedding(table, from_vector({1, 11}, {2}, DType::i32)),
                    Catch::Contains("token id 11") && Catch::Contains("[0, 11)") && Catch::Contains("[11, 4]"));
  CHECK_THROWS_WITH(embedding(table, from_vector({-1}, {1}, DType::i64)), Catch::Contains("token id -1"));
}

TEST_CASE("embedding: CUDA matches CPU, ids on either device, repeated ids in the gradient",
          "[ops][embedding][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor w = randn({1000, 67}, DType::f32, 3).set_requires_grad();
  Tensor ids = randint({4, 33}, 1000, DType::i32, default_generator());
  ids.data<int32_t>()[5] = ids.data<int32_t>()[6] = 7;  // a repeated id sums its rows
  for (bool ids_on_gpu : {false, true}) {
    moetrain::testing::check_cuda_matches_cpu([&](const Tensors& in) {
      Tensor i = in[0].is_cuda() && ids_on_gpu ? ids.to(kCuda) : ids;
      return Tensors{embedding(in[0], i)};
    }, {w}, {true}, DType::f32, moetrain::testing::tolerance_for(DType::f32));
  }
  // Host ids are checked for a CUDA table too (device ids are not: an id outside
  // gives a NaN row, embedding_device_plan_test.cpp).
  Tensor bad = full({3}, 1000, DType::i64);
  CHECK_THROWS_WITH(embedding(w.detach().to(kCuda), bad), Catch::Contains("out of range"));
}
