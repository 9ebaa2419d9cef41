// Copies and conversions: clone, to(DType) with gradients, to(Device) on the
// host, and contiguous() of views.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using moetrain::testing::check_gradients;

namespace {

// v rounded to f32, then to the nearer of its two bf16 neighbours (ties to the
// even one), by value. Finite values below the bf16 overflow only.
double through_bf16(double v) {
  float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t down_bits = u & 0xffff0000u, up_bits = down_bits + 0x10000u;
  float down, up;
  std::memcpy(&down, &down_bits, 4);
  std::memcpy(&up, &up_bits, 4);
  double dd = std::abs(static_cast<double>(f) - down), du = std::abs(static_cast<double>(up) - f);
  if (dd != du) return dd < du ? down : up;
  return ((down_bits >> 16) & 1u) == 0 ? down : up;
}

}  // namespace

TEST_CASE("clone: a fresh copy with equal contents, for every dtype", "[ops][convert]") {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::u16}) {
    DYNAMIC_SECTION(dtype_name(dt)) {
      Tensor x = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, dt);
      Tensor y = x.clone();
      CHECK(bitwise_equal(x, y));
      CHECK_FALSE(y.same_storage(x));
      fill_(y, 0.0);
      CHECK(x.to_vector() == std::vector<double>{1, 2, 3, 4, 5, 6});
    }
  }
  // A clone of a view copies only the view.
  Tensor base = randn({4, 5}, DType::f32, 1);
  Tensor view = slice(base, 0, 1, 3);
  Tensor c = view.clone();
  CHECK(bitwise_equal(c, view));
  CHECK_FALSE(c.same_storage(base));
  CHECK(c.impl().storage->nbytes() == c.nbytes());
}

TEST_CASE("clone: gradient passes through; the clone is not a leaf", "[ops][convert]") {
  Tensor x = randn({3, 31}, DType::f64, 2);
  check_gradients([](const Tensors& in) { return in[0].clone(); }, {x});
  Tensor leaf = x.clone();
  CHECK(leaf.is_leaf());  // nothing required grad
  leaf.set_requires_grad(true);
  Tensor c = leaf.clone();
  CHECK(c.requires_grad());
  CHECK_FALSE(c.is_leaf());
}

TEST_CASE("to(DType): values round per dtype among f32/f64/bf16/i32/i64/u16", "[ops][convert]") {
  std::vector<double> v{0.0, 1.0, 2.5, -3.75, 1.0 / 3.0, 1234.5678, 65535.0, -0.0};
  Tensor x = from_vector(v, {8}, DType::f64);
  std::vector<double> to_f32 = x.to(DType::f32).to_vector();
  std::vector<double> to_bf16 = x.to(DType::bf16).to_vector();
  std::vector<double> to_i32 = x.to(DType::i32).to_vector();
  std::vector<double> to_i64 = x.to(DType::i64).to_vector();
  for (size_t i = 0; i < v.size(); ++i) {
    INFO("value " << v[i]);
    CHECK(to_f32[i] == static_cast<double>(static_cast<float>(v[i])));
    CHECK(to_bf16[i] == through_bf16(v[i]));
    CHECK(to_i32[i] == std::trunc(v[i]));
    CHECK(to_i64[i] == std::trunc(v[i]));
  }
  std::vector<double> nonneg{0, 1, 2.9, 300, 65535};
  CHECK(from_vector(nonneg, {5}, DType::f32).to(DType::u16).to_vector() == std::vector<double>{0, 1, 2, 300, 65535});
  // A large tensor (several parallel chunks) converts every element.
  Tensor big = randn({3, 40000}, DType::f64, 3);
  std::vector<double> b = big.to_vector(), bf = big.to(DType::f32).to_vector();
  for (size_t i = 0; i < b.size(); ++i) REQUIRE(bf[i] == static_cast<double>(static_cast<float>(b[i])));
}

TEST_CASE("to(DType): the same dtype returns the tensor itself", "[ops][convert]") {
  Tensor x = randn({3}, DType::f32, 4);
  x.set_requires_grad(true);
  Tensor y = x.to(DType::f32);
  CHECK(y.impl_ptr() == x.impl_ptr());
  CHECK(x.to(kCpu).impl_ptr() == x.impl_ptr());
}

TEST_CASE("to(DType): gradients through f64 -> f32 -> f64", "[ops][convert]") {
  Tensor x = randn({3, 31}, DType::f64, 5);
  x.set_requires_grad(true);
  Tensor mid = x.to(DType::f32);
  CHECK(mid.requires_grad());
  CHECK(mid.dtype() == DType::f32);
  Tensor y = mid.to(DType::f64);
  CHECK(y.dtype() == DType::f64);
  std::vector<double> vx = x.to_vector(), vy = y.to_vector();
  for (size_t i = 0; i < vx.size(); ++i) CHECK(vy[i] == static_cast<double>(static_cast<float>(vx[i])));
  Tensor up = randn({3, 31}, DType::f64, 6);
  y.backward(up);
  REQUIRE(x.grad().defined());
  CHECK(x.grad().dtype() == DType::f64);
  std::vector<double> u = up.to_vector(), g = x.grad().to_vector();
  // The gradient makes the same round trip: rounded to f32 on the way back.
  for (size_t i = 0; i < u.size(); ++i) CHECK(g[i] == static_cast<double>(static_cast<float>(u[i])));
}

TEST_CASE("to(DType): gradients through f32 -> f64 -> f32 are exact", "[ops][convert]") {
  Tensor x = randn({2, 33}, DType::f32, 7);
  x.set_requires_grad(true);
  Tensor up = randn({2, 33}, DType::f32, 8);
  mul(x.to(DType::f64), x.to(DType::f64)).to(DType::f32).backward(up);
  std::vector<double> vx = x.to_vector(), u = up.to_vector(), g = x.grad().to_vector();
  for (size_t i = 0; i < vx.size(); ++i)
    CHECK(g[i] == static_cast<double>(static_cast<float>(2 * vx[i] * static_cast<double>(static_cast<float>(u[i])))));
}

TEST_CASE("to(DType): gradients through bf16", "[ops][convert]") {
  Tensor x = randn({31}, DType::f32, 9);
  x.set_requires_grad(true);
  Tensor b = x.to(DType::bf16);
  CHECK(b.requires_grad());
  Tensor up = randn({31}, DType::f32, 10);
  b.to(DType::f32).backward(up);
  std::vector<double> u = up.to_vector(), g = x.grad().to_vector();
  for (size_t i = 0; i < u.size(); ++i) CHECK(g[i] == through_bf16(u[i]));
}

TEST_CASE("to(DType): conversions to integers record nothing", "[ops][convert]") {
  Tensor x = randn({4}, DType::f64, 11);
  x.set_requires_grad(true);
  for (DType dt : {DType::i32, DType::i64, DType::u16}) {
    Tensor y = add_scalar(mul(x, x), 1.0).to(dt);
    CHECK(y.dtype() == dt);
    CHECK_FALSE(y.requires_grad());
    CHECK(y.is_leaf());
  }
  // From integers to floats: a fresh leaf without gradient.
  Tensor f = arange(4).to(DType::f32);
  CHECK_FALSE(f.requires_grad());
  CHECK(f.to_vector() == std::vector<double>{0, 1, 2, 3});
}

TEST_CASE("contiguous: a slice view becomes a compact copy", "[ops][convert]") {
  Tensor base = randn({6, 5}, DType::f64, 12);
  for (auto [start, end] : {std::pair<int64_t, int64_t>{2, 4}, {0, 3}, {3, 6}}) {
    DYNAMIC_SECTION("rows " << start << ".." << end) {
      Tensor view = slice(base, 0, start, end);
      REQUIRE(view.same_storage(base));
      Tensor c = view.contiguous();
      CHECK_FALSE(c.same_storage(base));
      CHECK(bitwise_equal(c, view));
      CHECK(c.impl().offset == 0);
      CHECK(c.impl().storage->nbytes() == c.nbytes());
      CHECK(c.contiguous().impl_ptr() == c.impl_ptr());  // already compact
    }
  }
  // A full tensor and a reshape of it are already compact: returned as is.
  CHECK(base.contiguous().impl_ptr() == base.impl_ptr());
  Tensor r = reshape(base, {5, 6});
  CHECK(r.contiguous().impl_ptr() == r.impl_ptr());
}

TEST_CASE("contiguous: gradient flows through the copy", "[ops][convert]") {
  Tensor x = randn({4, 7}, DType::f64, 13);
  check_gradients([](const Tensors& in) { return slice(in[0], 0, 1, 3).contiguous(); }, {x});
  check_gradients([](const Tensors& in) { return in[0].contiguous(); }, {x});
}
