// Shape ops: reshape, flatten, permute, transpose, slice, concat, split and
// index_select, forward against index loops, gradients by finite differences,
// views vs copies, and the errors.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

namespace {

std::vector<int64_t> unravel(int64_t flat, const Shape& s) {
  std::vector<int64_t> idx(static_cast<size_t>(s.ndim()));
  for (int d = s.ndim() - 1; d >= 0; --d) {
    idx[static_cast<size_t>(d)] = flat % s[d];
    flat /= s[d];
  }
  return idx;
}

int64_t ravel(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t flat = 0;
  for (int d = 0; d < s.ndim(); ++d) flat = flat * s[d] + idx[static_cast<size_t>(d)];
  return flat;
}

// Distinct values, so a misplaced element cannot go unnoticed.
Tensor iota(const Shape& s, DType dt = DType::f64) {
  std::vector<double> v(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i) + 1;
  return from_vector(v, s, dt);
}

std::vector<double> permute_ref(const std::vector<double>& x, const Shape& in, const std::vector<int64_t>& perm) {
  std::vector<int64_t> out_dims;
  for (int64_t p : perm) out_dims.push_back(in[static_cast<int>(p)]);
  Shape out(out_dims);
  std::vector<double> y(x.size());
  for (int64_t o = 0; o < out.numel(); ++o) {
    std::vector<int64_t> oi = unravel(o, out), ii(oi.size());
    for (size_t d = 0; d < perm.size(); ++d) ii[static_cast<size_t>(perm[d])] = oi[d];
    y[static_cast<size_t>(o)] = x[static_cast<size_t>(ravel(ii, in))];
  }
  return y;
}

}  // namespace

TEST_CASE("reshape: a view with the same elements in the same order", "[ops][view]") {
  Tensor x = iota({2, 3, 4});
  Tensor y = reshape(x, {6, 4});
  CHECK(y.shape() == Shape{6, 4});
  CHECK(y.same_storage(x));
  CHECK(y.to_vector() == x.to_vector());
  CHECK(reshape(x, {24}).shape() == Shape{24});
  CHECK(reshape(x, {2, 3, 4}).shape() == Shape{2, 3, 4});
  CHECK(reshape(iota({1}), {}).shape() == Shape{});
  Tensor ints = arange(6, DType::i32);
  CHECK(reshape(ints, {3, 2}).to_vector() == ints.to_vector());
}

TEST_CASE("reshape: one extent may be -1", "[ops][view]") {
  Tensor x = iota({2, 3, 4});
  CHECK(reshape(x, {-1, 4}).shape() == Shape{6, 4});
  CHECK(reshape(x, {2, -1}).shape() == Shape{2, 12});
  CHECK(reshape(x, {-1}).shape() == Shape{24});
  CHECK(reshape(x, {3, -1, 2}).shape() == Shape{3, 4, 2});
  CHECK(reshape(x, {-1, 4}).same_storage(x));
  CHECK(x.reshape({-1, 6}).shape() == Shape{4, 6});
}

TEST_CASE("reshape: gradients", "[ops][view]") {
  Tensor x = randn({3, 31}, DType::f64, 1);
  check_gradients([](const Tensors& in) { return reshape(in[0], {31, 3}); }, {x});
  check_gradients([](const Tensors& in) { return reshape(in[0], {3, 31}); }, {x});  // same shape, still recorded
}

TEST_CASE("reshape: bad shapes throw naming the op", "[ops][view][errors]") {
  Tensor x = iota({2, 3, 4});
  CHECK_THROWS_WITH(reshape(x, {5, 5}), Catch::Contains("reshape") && Catch::Contains("[2, 3, 4]"));
  CHECK_THROWS_WITH(reshape(x, {-1, 5}), Catch::Contains("reshape") && Catch::Contains("[2, 3, 4]"));
  CHECK_THROWS_WITH(reshape(x, {-1, -1}), Catch::Contains("reshape"));
  CHECK_THROWS_WITH(reshape(x, {-2, 12}), Catch::Contains("reshape"));
}

TEST_CASE("flatten: merges the dims from start to end", "[ops][view]") {
  Tensor x = iota({2, 3, 4, 5});
  CHECK(flatten(x).shape() == Shape{120});
  CHECK(flatten(x, 1).shape() == Shape{2, 60});
  CHECK(flatten(x, 1, 2).shape() == Shape{2, 12, 5});
  CHECK(flatten(x, -3, -2).shape() == Shape{2, 12, 5});
  CHECK(flatten(x, 2, 2).shape() == Shape{2, 3, 4, 5});
  CHECK(flatten(x, 0, 1).to_vector() == x.to_vector());
  CHECK(flatten(x, 0, 1).same_storage(x));
  CHECK(flatten(from_vector({3}, {}, DType::f64)).shape() == Shape{1});
  CHECK_THROWS_WITH(flatten(x, 2, 1), Catch::Contains("flatten"));
  CHECK_THROWS_AS(flatten(x, 0, 4), Error);
  check_gradients([](const Tensors& in) { return flatten(in[0], 1, 2); }, {randn({2, 3, 5}, DType::f64, 2)});
}

TEST_CASE("permute: forward matches an index loop", "[ops][view]") {
  struct Case {
    Shape shape;
    std::vector<int64_t> perm;
  };
  std::vector<Case> cases = {{{3, 31}, {1, 0}},
                             {{2, 3, 5}, {2, 0, 1}},
                             {{2, 3, 5}, {1, 2, 0}},
                             {{2, 3, 5}, {0, 2, 1}},
                             {{2, 3, 5}, {0, 1, 2}},
                             {{2, 3, 4, 5}, {3, 1, 0, 2}},
                             {{33, 1, 37}, {2, 1, 0}}};
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.shape.str() << " perm " << fmt::format("{}", fmt::join(c.perm, ","))) {
      Tensor x = iota(c.shape);
      Tensor y = permute(x, c.perm);
      std::vector<int64_t> want_dims;
      for (int64_t p : c.perm) want_dims.push_back(c.shape[static_cast<int>(p)]);
      CHECK(y.shape() == Shape(want_dims));
      CHECK(y.to_vector() == permute_ref(x.to_vector(), c.shape, c.perm));
      CHECK_FALSE(y.same_storage(x));
    }
  }
  // Negative dims, integer and bf16 dtypes (byte copies).
  Tensor x = iota({2, 3, 4});
  CHECK(permute(x, {-1, 0, -2}).to_vector() == permute_ref(x.to_vector(), {2, 3, 4}, {2, 0, 1}));
  for (DType dt : {DType::i64, DType::i32, DType::u16, DType::bf16, DType::f32}) {
    Tensor xi = iota({2, 3, 4}, dt);
    CHECK(permute(xi, {1, 2, 0}).to_vector() == permute_ref(xi.to_vector(), {2, 3, 4}, {1, 2, 0}));
  }
}

TEST_CASE("permute: large copies split over threads match the loop", "[ops][view]") {
  Tensor x = iota({64, 33, 31});
  CHECK(permute(x, {2, 0, 1}).to_vector() == permute_ref(x.to_vector(), {64, 33, 31}, {2, 0, 1}));
  CHECK(permute(x, {1, 0, 2}).to_vector() == permute_ref(x.to_vector(), {64, 33, 31}, {1, 0, 2}));
}

TEST_CASE("permute and transpose: gradients", "[ops][view]") {
  Tensor x = randn({2, 3, 5}, DType::f64, 3);
  check_gradients([](const Tensors& in) { return permute(in[0], {2, 0, 1}); }, {x});
  check_gradients([](const Tensors& in) { return permute(in[0], {1, 2, 0}); }, {x});
  check_gradients([](const Tensors& in) { return transpose(in[0], 0, 2); }, {x});
  check_gradients([](const Tensors& in) { return transpose(in[0], -1, -2); }, {x});
}

TEST_CASE("transpose: swaps two dims", "[ops][view]") {
  Tensor x = iota({3, 31});
  Tensor y = transpose(x, 0, 1);
  REQUIRE(y.shape() == Shape{31, 3});
  std::vector<double> vx = x.to_vector(), vy = y.to_vector();
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 31; ++j) CHECK(vy[static_cast<size_t>(j * 3 + i)] == vx[static_cast<size_t>(i * 31 + j)]);
  Tensor z = iota({2, 3, 4});
  CHECK(transpose(z, -1, 0).to_vector() == permute_ref(z.to_vector(), {2, 3, 4}, {2, 1, 0}));
  CHECK(transpose(z, 1, 1).to_vector() == z.to_vector());
  CHECK_THROWS_AS(transpose(z, 0, 3), Error);
}

TEST_CASE("permute: bad dims throw naming the op", "[ops][view][errors]") {
  Tensor x = iota({2, 3, 4});
  CHECK_THROWS_WITH(permute(x, {0, 1}), Catch::Contains("permute") && Catch::Contains("[2, 3, 4]"));
  CHECK_THROWS_WITH(permute(x, {0, 1, 1}), Catch::Contains("permute") && Catch::Contains("repeated"));
  CHECK_THROWS_WITH(permute(x, {0, 1, -2}), Catch::Contains("permute"));
  CHECK_THROWS_AS(permute(x, {0, 1, 3}), Error);
}

TEST_CASE("slice: along dim 0 is a view sharing storage", "[ops][view]") {
  Tensor x = iota({5, 4});
  Tensor s = slice(x, 0, 1, 4);
  REQUIRE(s.shape() == Shape{3, 4});
  CHECK(s.same_storage(x));
  std::vector<double> vx = x.to_vector(), vs = s.to_vector();
  for (size_t i = 0; i < vs.size(); ++i) CHECK(vs[i] == vx[4 + i]);
  // Writes through the view land in the base tensor.
  s.data<double>()[0] = -7;
  CHECK(x.to_vector()[4] == -7);
  // A slice of a slice composes offsets.
  Tensor ss = slice(s, 0, 1, 3);
  CHECK(ss.same_storage(x));
  CHECK(ss.to_vector()[0] == vx[8]);
  // Leading dims of extent 1 keep the range contiguous, so a later dim is a view too.
  Tensor one = iota({1, 6, 2});
  Tensor v1 = slice(one, 1, 2, 5);
  CHECK(v1.same_storage(one));
  std::vector<double> want{5, 6, 7, 8, 9, 10};
  CHECK(v1.to_vector() == want);
}

TEST_CASE("slice: along other dims is a copy matching a loop", "[ops][view]") {
  Tensor x = iota({3, 31, 5});
  std::vector<double> vx = x.to_vector();
  SECTION("dim 1") {
    Tensor s = slice(x, 1, 4, 29);
    REQUIRE(s.shape() == Shape{3, 25, 5});
    CHECK_FALSE(s.same_storage(x));
    std::vector<double> vs = s.to_vector();
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 25; ++j)
        for (int k = 0; k < 5; ++k)
          REQUIRE(vs[static_cast<size_t>((i * 25 + j) * 5 + k)] == vx[static_cast<size_t>((i * 31 + j + 4) * 5 + k)]);
  }
  SECTION("last dim, negative bounds") {
    Tensor s = slice(x, -1, -3, -1);  // [2, 4)
    REQUIRE(s.shape() == Shape{3, 31, 2});
    CHECK_FALSE(s.same_storage(x));
    std::vector<double> vs = s.to_vector();
    for (int r = 0; r < 93; ++r)
      for (int k = 0; k < 2; ++k) REQUIRE(vs[static_cast<size_t>(r * 2 + k)] == vx[static_cast<size_t>(r * 5 + k + 2)]);
  }
  SECTION("empty range and full range") {
    CHECK(slice(x, 1, 7, 7).shape() == Shape{3, 0, 5});
    CHECK(slice(x, 2, 0, 5).to_vector() == vx);
  }
}

TEST_CASE("slice: gradients along each dim", "[ops][view]") {
  Tensor x = randn({3, 31}, DType::f64, 4);
  check_gradients([](const Tensors& in) { return slice(in[0], 0, 1, 3); }, {x});
  check_gradients([](const Tensors& in) { return slice(in[0], 1, 5, 20); }, {x});
  check_gradients([](const Tensors& in) { return slice(in[0], -1, -4, 31); }, {x});
  Tensor y = randn({2, 3, 4}, DType::f64, 5);
  check_gradients([](const Tensors& in) { return slice(in[0], 1, 1, 2); }, {y});
}

TEST_CASE("slice: out-of-range bounds throw naming the op", "[ops][view][errors]") {
  Tensor x = iota({3, 4});
  CHECK_THROWS_WITH(slice(x, 1, 0, 5), Catch::Contains("slice") && Catch::Contains("[3, 4]"));
  CHECK_THROWS_WITH(slice(x, 0, 2, 1), Catch::Contains("slice"));
  CHECK_THROWS_WITH(slice(x, 0, -5, 2), Catch::Contains("slice"));
  CHECK_THROWS_AS(slice(x, 2, 0, 1), Error);
}

TEST_CASE("concat: forward matches a loop along each dim", "[ops][view]") {
  Tensor a = iota({2, 3, 4}), b = mul_scalar(iota({2, 3, 4}), -1.0);
  std::vector<double> va = a.to_vector(), vb = b.to_vector();
  for (int d = 0; d < 3; ++d) {
    DYNAMIC_SECTION("dim " << d) {
      // c has extent 1 along d.
      Tensor c = from_vector(std::vector<double>(static_cast<size_t>(24 / a.size(d)), 100.0), a.shape().with(d, 1),
                             DType::f64);
      Tensor y = concat({a, b, c}, d);
      Shape ys = a.shape().with(d, 2 * a.size(d) + 1);
      REQUIRE(y.shape() == ys);
      std::vector<double> vy = y.to_vector();
      for (int64_t f = 0; f < ys.numel(); ++f) {
        std::vector<int64_t> idx = unravel(f, ys);
        int64_t at = idx[static_cast<size_t>(d)], n = a.size(d);
        double want;
        if (at < n) {
          want = va[static_cast<size_t>(ravel(idx, a.shape()))];
        } else if (at < 2 * n) {
          idx[static_cast<size_t>(d)] = at - n;
          want = vb[static_cast<size_t>(ravel(idx, a.shape()))];
        } else {
          want = 100.0;
        }
        REQUIRE(vy[static_cast<size_t>(f)] == want);
      }
    }
  }
  CHECK(concat({a, b}, -1).shape() == Shape{2, 3, 8});
  CHECK(concat({a}, 0).to_vector() == va);
  Tensor i1 = arange(3, DType::i32), i2 = arange(2, DType::i32);
  CHECK(concat({i1, i2}, 0).to_vector() == std::vector<double>{0, 1, 2, 0, 1});
}

TEST_CASE("slice and concat: tensors with an empty leading dim", "[ops][view][empty]") {
  Tensor x = zeros({0, 5});
  CHECK(slice(x, 1, 1, 3).shape() == Shape{0, 2});
  CHECK(concat({zeros({0, 2}), zeros({0, 3})}, 1).shape() == Shape{0, 5});
  Tensors parts = split(x, {2, 3}, 1);
  CHECK(parts[1].shape() == Shape{0, 3});
}

TEST_CASE("concat: gradients", "[ops][view]") {
  Tensor a = randn({3, 31}, DType::f64, 6), b = randn({3, 5}, DType::f64, 7), c = randn({2, 31}, DType::f64, 8);
  check_gradients([](const Tensors& in) { return concat({in[0], in[1]}, 1); }, {a, b});
  check_gradients([](const Tensors& in) { return concat({in[0], in[1]}, 0); }, {a, c});
  check_gradients([](const Tensors& in) { return concat({in[0], in[0]}, 0); }, {a});  // used twice
}

TEST_CASE("concat: incompatible inputs throw naming the op", "[ops][view][errors]") {
  Tensor a = iota({2, 3}), b = iota({3, 3});
  CHECK_THROWS_WITH(concat({a, b}, 1), Catch::Contains("concat") && Catch::Contains("[3, 3]") && Catch::Contains("[2, 3]"));
  CHECK_THROWS_WITH(concat({a, iota({2, 3, 1})}, 0), Catch::Contains("concat"));
  CHECK_THROWS_WITH(concat({a, iota({2, 3}, DType::f32)}, 0), Catch::Contains("concat") && Catch::Contains("dtype"));
  CHECK_THROWS_WITH(concat({}, 0), Catch::Contains("concat"));
  CHECK_THROWS_AS(concat({a, a}, 2), Error);
}

TEST_CASE("split: parts match slices and concat back to the input", "[ops][view]") {
  Tensor x = iota({3, 10});
  Tensors parts = split(x, {2, 0, 5, 3}, 1);
  REQUIRE(parts.size() == 4);
  CHECK(parts[0].shape() == Shape{3, 2});
  CHECK(parts[1].shape() == Shape{3, 0});
  CHECK(parts[2].shape() == Shape{3, 5});
  CHECK(parts[3].shape() == Shape{3, 3});
  std::vector<double> vx = x.to_vector(), v2 = parts[2].to_vector();
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j) CHECK(v2[static_cast<size_t>(i * 5 + j)] == vx[static_cast<size_t>(i * 10 + 2 + j)]);
  CHECK(concat(parts, 1).to_vector() == vx);
  Tensors rows = split(x, {1, 2}, 0);
  CHECK(rows[1].same_storage(x));
  CHECK(rows[1].to_vector() == std::vector<double>(vx.begin() + 10, vx.end()));
}

TEST_CASE("split: gradients", "[ops][view]") {
  Tensor x = randn({3, 31}, DType::f64, 9);
  check_gradients([](const Tensors& in) { return split(in[0], {10, 21}, 1); }, {x});
  check_gradients([](const Tensors& in) { return split(in[0], {1, 2}, 0); }, {x});
  check_gradients([](const Tensors& in) { return split(in[0], {3, 28}, -1)[1]; }, {x});  // one part unused
  check_gradients([](const Tensors& in) { return split(in[0], {2, 0, 29}, 1); }, {x});   // an empty part
}

TEST_CASE("split: sizes must sum to the extent", "[ops][view][errors]") {
  Tensor x = iota({3, 10});
  CHECK_THROWS_WITH(split(x, {4, 5}, 1), Catch::Contains("split") && Catch::Contains("[3, 10]"));
  CHECK_THROWS_WITH(split(x, {12, -2}, 1), Catch::Contains("split"));
}

TEST_CASE("index_select: forward matches a loop, i32 and i64 indices", "[ops][view]") {
  Tensor x = iota({4, 5, 3});
  std::vector<double> vx = x.to_vector();
  for (DType it : {DType::i32, DType::i64}) {
    for (int d = 0; d < 3; ++d) {
      DYNAMIC_SECTION(dtype_name(it) << " dim " << d) {
        int64_t n = x.size(d);
        std::vector<double> iv{static_cast<double>(n - 1), 0, 1, 0, static_cast<double>(n - 1), 1};
        Tensor index = from_vector(iv, {6}, it);
        Tensor y = index_select(x, d, index);
        Shape ys = x.shape().with(d, 6);
        REQUIRE(y.shape() == ys);
        std::vector<double> vy = y.to_vector();
        for (int64_t f = 0; f < ys.numel(); ++f) {
          std::vector<int64_t> idx = unravel(f, ys);
          idx[static_cast<size_t>(d)] = static_cast<int64_t>(iv[static_cast<size_t>(idx[static_cast<size_t>(d)])]);
          REQUIRE(vy[static_cast<size_t>(f)] == vx[static_cast<size_t>(ravel(idx, x.shape()))]);
        }
      }
    }
  }
  // Embedding-style lookup of integer rows, and an empty index.
  Tensor table = iota({5, 2}, DType::i64);
  Tensor rows = index_select(table, 0, from_vector({4, 4, 2}, {3}, DType::i32));
  CHECK(rows.to_vector() == std::vector<double>{9, 10, 9, 10, 5, 6});
  CHECK(index_select(x, 1, zeros({0}, DType::i64)).shape() == Shape{4, 0, 3});
}

TEST_CASE("index_select: repeated indices accumulate in backward", "[ops][view]") {
  Tensor x = randn({5, 7}, DType::f64, 10);
  for (DType it : {DType::i32, DType::i64}) {
    DYNAMIC_SECTION(dtype_name(it)) {
      Tensor rep = from_vector({3, 1, 3, 3, 0, 1}, {6}, it);
      check_gradients([rep](const Tensors& in) { return index_select(in[0], 0, rep); }, {x});
      check_gradients([rep](const Tensors& in) { return index_select(in[0], 1, rep); }, {x});
      check_gradients([rep](const Tensors& in) { return index_select(in[0], -1, rep); }, {randn({3, 2, 5}, DType::f64, 11)});
    }
  }
  // Counting: the gradient of a sum of selected rows is the number of times each row was picked.
  Tensor w = zeros({4, 3}, DType::f64);
  w.set_requires_grad(true);
  sum(index_select(w, 0, from_vector({2, 2, 2, 0, 2}, {5}, DType::i64))).backward();
  std::vector<double> g = w.grad().to_vector();
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 3; ++c) CHECK(g[static_cast<size_t>(r * 3 + c)] == (r == 2 ? 4.0 : r == 0 ? 1.0 : 0.0));
}

TEST_CASE("index_select: backward is the same for 1 and 2 threads", "[ops][view]") {
  // Both kernel paths: few outer rows (split over columns) and many (split over rows).
  for (int64_t dim : {0, 1}) {
    DYNAMIC_SECTION("dim " << dim) {
      Tensor x = randn({64, 300}, DType::f32, 12);
      Generator gen(13);
      Tensor index = randint({500}, x.size(dim), DType::i64, gen);
      Tensor up = randn(x.shape().with(static_cast<int>(dim), 500), DType::f32, 14);
      auto grad_with = [&](int threads) {
        cpu::set_num_threads(threads);
        Tensor leaf = x.detach().clone();
        leaf.set_requires_grad(true);
        index_select(leaf, dim, index).backward(up);
        return leaf.grad();
      };
      int saved = cpu::num_threads();
      Tensor one = grad_with(1), two = grad_with(2);
      cpu::set_num_threads(saved);
      CHECK(moetrain::testing::bitwise_equal(one, two));
    }
  }
}

TEST_CASE("index_select: bad indices throw naming the op", "[ops][view][errors]") {
  Tensor x = iota({4, 5});
  CHECK_THROWS_WITH(index_select(x, 0, from_vector({0, 4}, {2}, DType::i64)),
                    Catch::Contains("index_select") && Catch::Contains("4") && Catch::Contains("out of range"));
  CHECK_THROWS_WITH(index_select(x, 1, from_vector({-1}, {1}, DType::i32)),
                    Catch::Contains("index_select") && Catch::Contains("-1"));
  CHECK_THROWS_WITH(index_select(x, 0, from_vector({0, 1}, {2}, DType::f32)), Catch::Contains("index_select"));
  CHECK_THROWS_WITH(index_select(x, 0, zeros({2, 1}, DType::i64)), Catch::Contains("index_select") && Catch::Contains("rank"));
  CHECK_THROWS_AS(index_select(x, 2, zeros({1}, DType::i64)), Error);
}

TEST_CASE("view ops: CUDA matches CPU (permute, slice, concat, index_select), with gradients",
          "[ops][view][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor x = randn({3, 33, 5, 7}, DType::f32, 1).set_requires_grad();
  Tensor y = randn({3, 4, 5, 7}, DType::f32, 2).set_requires_grad();
  Tensor idx = randint({40}, 33, DType::i64, default_generator());
  moetrain::testing::check_cuda_matches_cpu([idx](const Tensors& in) {
    return Tensors{permute(in[0], {2, 0, 3, 1}), transpose(in[0], 1, 3), slice(in[0], 1, 3, 30),
                   slice(in[0], 0, 1, 2), concat({in[0], in[1]}, 1), index_select(in[0], 1, idx),
                   index_select(in[0], 1, in[0].is_cuda() ? idx.to(kCuda) : idx)};
  }, {x, y}, {true, true}, DType::f32, {1e-6, 1e-6});  // copies and in-order sums
  // bf16 and i64 tensors move as raw elements.
  Tensor t = arange(60, DType::i64).reshape({3, 4, 5});
  CHECK(moetrain::testing::bitwise_equal(permute(t.to(kCuda), {2, 1, 0}).to(kCpu), permute(t, {2, 1, 0})));
  CHECK_THROWS_WITH(index_select(x.to(kCuda), 1, full({2}, 40, DType::i64)), Catch::Contains("out of range"));
}
