// Shape: extents, numel, negative dims, derived shapes, equality and printing.
#include <catch2/catch.hpp>

#include <vector>

#include "moetrain.h"
#include "testing.h"

using namespace moetrain;

TEST_CASE("shape: extents, rank and numel", "[core][shape]") {
  Shape s{2, 3, 5};
  CHECK(s.ndim() == 3);
  CHECK(s[0] == 2);
  CHECK(s[1] == 3);
  CHECK(s[2] == 5);
  CHECK(s.numel() == 30);
  CHECK(s.numel(1, 3) == 15);
  CHECK(s.numel(0, 1) == 2);
  CHECK(s.numel(1, 1) == 1);  // empty range
  CHECK(s.vec() == std::vector<int64_t>{2, 3, 5});
  std::vector<int64_t> dims(s.dims().begin(), s.dims().end());
  CHECK(dims == std::vector<int64_t>{2, 3, 5});
}

TEST_CASE("shape: rank 0 has one element, a zero extent has none", "[core][shape]") {
  Shape scalar;
  CHECK(scalar.ndim() == 0);
  CHECK(scalar.numel() == 1);
  CHECK(scalar.str() == "[]");
  Shape empty_rows{0, 4};
  CHECK(empty_rows.numel() == 0);
  CHECK(empty_rows.numel(1, 2) == 4);
}

TEST_CASE("shape: constructors from span and vector agree", "[core][shape]") {
  std::vector<int64_t> v{4, 1, 7};
  Shape from_vec(v);
  Shape from_span(std::span<const int64_t>(v.data(), v.size()));
  CHECK(from_vec == Shape{4, 1, 7});
  CHECK(from_span == Shape{4, 1, 7});
}

TEST_CASE("shape: negative dims count from the end", "[core][shape]") {
  Shape s{2, 3, 5};
  CHECK(s.size(-1) == 5);
  CHECK(s.size(-2) == 3);
  CHECK(s.size(-3) == 2);
  CHECK(s.size(0) == 2);
  CHECK(s.normalize_dim(-1) == 2);
  CHECK(s.normalize_dim(-3) == 0);
  CHECK(s.normalize_dim(1) == 1);
}

TEST_CASE("shape: out-of-range dims throw naming the dim and the shape", "[core][shape][errors]") {
  Shape s{2, 3, 5};
  CHECK_THROWS_AS(s.size(3), Error);
  CHECK_THROWS_AS(s.size(-4), Error);
  CHECK_THROWS_WITH(s.normalize_dim(7), Catch::Contains("7") && Catch::Contains("[2, 3, 5]"));
  CHECK_THROWS_WITH(s.normalize_dim(-4), Catch::Contains("-4") && Catch::Contains("[2, 3, 5]"));
  CHECK_THROWS_AS(Shape().normalize_dim(0), Error);
}

TEST_CASE("shape: construction rejects negative extents and too many dims", "[core][shape][errors]") {
  CHECK_THROWS_WITH((Shape{2, -3}), Catch::Contains("negative"));
  std::vector<int64_t> nine(static_cast<size_t>(Shape::kMaxDims) + 1, 1);
  CHECK_THROWS_AS(Shape(nine), Error);
  std::vector<int64_t> eight(static_cast<size_t>(Shape::kMaxDims), 2);
  Shape max_rank(eight);
  CHECK(max_rank.ndim() == Shape::kMaxDims);
  CHECK(max_rank.numel() == 256);
  CHECK_THROWS_AS(max_rank.appended(2), Error);
}

TEST_CASE("shape: drop_last, with and appended return modified copies", "[core][shape]") {
  Shape s{2, 3, 5};
  CHECK(s.drop_last() == Shape{2, 3});
  CHECK(s.drop_last().drop_last().drop_last() == Shape{});
  CHECK_THROWS_AS(Shape().drop_last(), Error);
  CHECK(s.with(1, 7) == Shape{2, 7, 5});
  CHECK(s.with(-1, 9) == Shape{2, 3, 9});
  CHECK_THROWS_AS(s.with(3, 1), Error);
  CHECK(s.appended(4) == Shape{2, 3, 5, 4});
  CHECK(Shape().appended(6) == Shape{6});
  CHECK(s == Shape{2, 3, 5});  // unchanged
}

TEST_CASE("shape: equality compares rank and every extent", "[core][shape]") {
  CHECK(Shape{2, 3} == Shape{2, 3});
  CHECK_FALSE(Shape{2, 3} == Shape{3, 2});
  CHECK_FALSE(Shape{2, 3} == Shape{2, 3, 1});
  CHECK_FALSE(Shape{6} == Shape{2, 3});
  CHECK(Shape{} == Shape());
  // drop_last must not leave a stale extent that a later appended() would expose.
  CHECK(Shape{2, 3}.drop_last().appended(4) == Shape{2, 4});
}

TEST_CASE("shape: str and fmt print the extents in brackets", "[core][shape]") {
  CHECK(Shape{2, 3, 5}.str() == "[2, 3, 5]");
  CHECK(Shape{7}.str() == "[7]");
  CHECK(fmt::format("{}", Shape{4, 1}) == "[4, 1]");
}
