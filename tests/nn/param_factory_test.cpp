// ParamFactory's Init::first_rows (a padded vocabulary's table, docs/model.md#padded-vocabulary):
// the drawn rows are those of a tensor of that many rows, the rest zero, and the
// generator advances as for that smaller tensor, whether the factory allocates, skips
// (another pipeline stage's parameter) or keeps a range of rows.
#include <catch2/catch.hpp>

#include "moetrain.h"
#include "nn/param_factory.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;

TEST_CASE("param factory: Init::first_rows draws the first rows as a smaller tensor, zeroes the rest and advances "
          "the generator by the drawn rows only", "[nn][param_factory]") {
  for (const Init& base : {Init::normal(0.7), Init::trunc_normal(0.5, -3, 3)}) {
    INFO((base.kind == Init::Kind::normal ? "normal" : "trunc_normal"));
    // The reference: a [3, 4] tensor, then another parameter.
    ParamFactory plain(true, DType::f64, 11);
    const Tensor want = plain.make("table", {3, 4}, base, "embedding", false);
    const Tensor want_next = plain.make("next", {6}, Init::normal(1.0), "norm", false);

    ParamFactory padded(true, DType::f64, 11);
    const Tensor got = padded.make("table", {5, 4}, Init::first_rows(base, 3), "embedding", false);
    const Tensor got_next = padded.make("next", {6}, Init::normal(1.0), "norm", false);
    REQUIRE(got.shape() == Shape{5, 4});
    CHECK(bitwise_equal(slice(got.detach(), 0, 0, 3).contiguous(), want));
    CHECK(slice(got.detach(), 0, 3, 5).contiguous().to_vector() == std::vector<double>(8, 0.0));
    CHECK(bitwise_equal(got_next, want_next));
    CHECK(padded.specs().front().shape == Shape{5, 4});

    // Skipped (another stage's table): nothing kept, the next parameter the same.
    ParamFactory skipping(true, DType::f64, 11);
    skipping.set_skipping(true);
    CHECK(!skipping.make("table", {5, 4}, Init::first_rows(base, 3), "embedding", false).defined());
    skipping.set_skipping(false);
    CHECK(bitwise_equal(skipping.make("next", {6}, Init::normal(1.0), "norm", false), want_next));

    // A range of rows across the boundary: those rows of the whole table.
    ParamFactory rows(true, DType::f64, 11);
    const Tensor part = rows.make_rows("table", {5, 4}, 1, 4, Init::first_rows(base, 3), "embedding", false);
    CHECK(bitwise_equal(part, slice(got.detach(), 0, 1, 4).contiguous()));
    CHECK(bitwise_equal(rows.make("next", {6}, Init::normal(1.0), "norm", false), want_next));
  }
}
