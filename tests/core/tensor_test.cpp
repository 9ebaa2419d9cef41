// Tensor handles, factories, element access, aliases and the in-place helpers.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moetrain.h"
#include "testing.h"

using namespace moetrain;

TEST_CASE("tensor: a default tensor is undefined and refuses use", "[core][tensor]") {
  Tensor t;
  CHECK_FALSE(t.defined());
  CHECK_THROWS_WITH(t.shape(), Catch::Contains("undefined"));
  CHECK(describe(t) == "undefined tensor");
}

TEST_CASE("tensor: factories give the named contents, shape and dtype", "[core][tensor]") {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::u16}) {
    DYNAMIC_SECTION(dtype_name(dt)) {
      Tensor z = zeros({3, 5}, dt), o = ones({3, 5}, dt), f = full({2, 2}, 7.0, dt), e = empty({4, 1}, dt);
      CHECK(z.shape() == Shape{3, 5});
      CHECK(z.dtype() == dt);
      CHECK(z.numel() == 15);
      CHECK(z.dim() == 2);
      CHECK(z.nbytes() == 15 * dtype_size(dt));
      CHECK(z.is_cpu());
      CHECK(e.shape() == Shape{4, 1});
      CHECK(e.dtype() == dt);
      for (double v : z.to_vector()) CHECK(v == 0.0);
      for (double v : o.to_vector()) CHECK(v == 1.0);
      for (double v : f.to_vector()) CHECK(v == 7.0);
      Tensor zl = zeros_like(f), el = empty_like(f);
      CHECK(zl.shape() == f.shape());
      CHECK(zl.dtype() == dt);
      CHECK(el.shape() == f.shape());
      CHECK(el.dtype() == dt);
      for (double v : zl.to_vector()) CHECK(v == 0.0);
      CHECK_FALSE(zl.same_storage(f));
    }
  }
}

TEST_CASE("tensor: large fills cover every element (parallel chunks)", "[core][tensor]") {
  int64_t n = (1 << 17) + 3;  // above the fill grain, not a multiple of it
  Tensor t = full({n}, 2.5, DType::f32);
  std::vector<double> v = t.to_vector();
  for (int64_t i = 0; i < n; ++i) REQUIRE(v[static_cast<size_t>(i)] == 2.5);
  fill_(t, 0.0);
  v = t.to_vector();
  for (int64_t i = 0; i < n; ++i) REQUIRE(v[static_cast<size_t>(i)] == 0.0);
}

TEST_CASE("tensor: arange counts from zero in the requested dtype", "[core][tensor]") {
  Tensor a = arange(5);
  CHECK(a.dtype() == DType::i64);
  CHECK(a.shape() == Shape{5});
  const int64_t* p = a.data<int64_t>();
  for (int64_t i = 0; i < 5; ++i) CHECK(p[i] == i);
  Tensor f = arange(4, DType::f64);
  CHECK(f.to_vector() == std::vector<double>{0, 1, 2, 3});
  CHECK(arange(0).numel() == 0);
}

TEST_CASE("tensor: from_vector and from_span copy and convert", "[core][tensor]") {
  std::vector<double> v{1.5, -2.0, 3.25, 0.0, 8.0, -0.5};
  Tensor f = from_vector(v, {2, 3}, DType::f64);
  CHECK(f.shape() == Shape{2, 3});
  CHECK(f.to_vector() == v);
  v[0] = 100;  // the tensor holds a copy
  CHECK(f.to_vector()[0] == 1.5);

  Tensor i = from_vector({1.9, -1.9, 7.0}, {3}, DType::i32);  // integer conversion truncates toward zero
  const int32_t* pi = i.data<int32_t>();
  CHECK(pi[0] == 1);
  CHECK(pi[1] == -1);
  CHECK(pi[2] == 7);

  std::vector<uint16_t> tokens{0, 65535, 42, 7};
  Tensor u = from_span<uint16_t>(tokens, {2, 2});
  CHECK(u.dtype() == DType::u16);
  CHECK(u.to_vector() == std::vector<double>{0, 65535, 42, 7});

  CHECK_THROWS_WITH(from_vector({1, 2, 3}, {2, 2}), Catch::Contains("from_vector") && Catch::Contains("[2, 2]"));
  std::vector<float> three{1, 2, 3};
  CHECK_THROWS_WITH(from_span<float>(three, {4}), Catch::Contains("from_span"));
}

TEST_CASE("tensor: data<T> checks the dtype; item reads one element", "[core][tensor]") {
  Tensor t = from_vector({4.5}, {1}, DType::f32);
  CHECK(t.data<float>()[0] == 4.5f);
  CHECK_THROWS_WITH(t.data<double>(), Catch::Contains("f32") && Catch::Contains("f64"));
  CHECK(t.item<float>() == 4.5f);
  CHECK(t.item<double>() == 4.5);
  CHECK(from_vector({-3}, {}, DType::i64).item<int64_t>() == -3);
  CHECK(from_vector({9}, {1, 1}, DType::i32).item<int32_t>() == 9);
  CHECK_THROWS_WITH(zeros({2}).item<float>(), Catch::Contains("item"));
}

TEST_CASE("tensor: item<int64_t> is exact beyond 2^53", "[core][tensor]") {
  // Counters and seeds kept in i64 tensors must read back exactly.
  std::vector<int64_t> big{(int64_t{1} << 53) + 1};
  Tensor t = from_span<int64_t>(big, {1});
  REQUIRE(t.data<int64_t>()[0] == (int64_t{1} << 53) + 1);
  CHECK(t.item<int64_t>() == (int64_t{1} << 53) + 1);
  std::vector<int64_t> max_i64{INT64_MAX};
  CHECK(from_span<int64_t>(max_i64, {}).item<int64_t>() == INT64_MAX);
}

TEST_CASE("tensor: copying a handle shares the data; clone does not", "[core][tensor]") {
  Tensor a = from_vector({1, 2, 3}, {3}, DType::f32);
  Tensor b = a;
  b.data<float>()[1] = 20;
  CHECK(a.to_vector()[1] == 20);
  CHECK(a.same_storage(b));
  CHECK(a.impl_ptr() == b.impl_ptr());
  Tensor c = a.clone();
  CHECK_FALSE(c.same_storage(a));
  c.data<float>()[0] = -1;
  CHECK(a.to_vector()[0] == 1);
}

TEST_CASE("tensor: alias views the same storage at an offset", "[core][tensor]") {
  Tensor base = from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {8}, DType::f64);
  Tensor v = alias(base, {2, 3}, 2);
  CHECK(v.same_storage(base));
  CHECK(v.shape() == Shape{2, 3});
  CHECK(v.to_vector() == std::vector<double>{2, 3, 4, 5, 6, 7});
  v.data<double>()[0] = 42;
  CHECK(base.to_vector()[2] == 42);
  Tensor vv = alias(v, {2}, 3);  // offsets compose
  CHECK(vv.to_vector() == std::vector<double>{5, 6});
  CHECK(vv.raw_data() == static_cast<void*>(base.data<double>() + 5));
}

TEST_CASE("tensor: detach shares storage and drops history", "[core][tensor]") {
  Tensor x = randn({3, 4}, DType::f64, 1);
  x.set_requires_grad(true);
  Tensor y = mul(x, x);
  CHECK(y.requires_grad());
  CHECK_FALSE(y.is_leaf());
  Tensor d = y.detach();
  CHECK(d.same_storage(y));
  CHECK(d.is_leaf());
  CHECK_FALSE(d.requires_grad());
  CHECK(d.shape() == y.shape());
  CHECK(d.to_vector() == y.to_vector());
}

TEST_CASE("tensor: set_requires_grad marks floating leaves only", "[core][tensor]") {
  Tensor w = zeros({2}, DType::f32);
  CHECK_FALSE(w.requires_grad());
  CHECK(w.is_leaf());
  w.set_requires_grad(true);
  CHECK(w.requires_grad());
  w.set_requires_grad(false);
  CHECK_FALSE(w.requires_grad());
  CHECK_NOTHROW(zeros({2}, DType::bf16).set_requires_grad(true));
  CHECK_THROWS_WITH(arange(3).set_requires_grad(true), Catch::Contains("set_requires_grad") && Catch::Contains("i64"));
  CHECK_NOTHROW(arange(3).set_requires_grad(false));
  w.set_requires_grad(true);
  Tensor y = mul_scalar(w, 2.0);
  CHECK_THROWS_WITH(y.set_requires_grad(true), Catch::Contains("leaves"));
}

TEST_CASE("tensor: grad, set_grad and zero_grad", "[core][tensor]") {
  Tensor w = zeros({3}, DType::f64);
  CHECK_FALSE(w.grad().defined());
  Tensor g = from_vector({1, 2, 3}, {3}, DType::f64);
  w.set_grad(g);
  REQUIRE(w.grad().defined());
  CHECK(w.grad().to_vector() == std::vector<double>{1, 2, 3});
  w.zero_grad();
  CHECK_FALSE(w.grad().defined());
}

TEST_CASE("tensor: fill_ and copy_ write in place", "[core][tensor]") {
  Tensor t = zeros({2, 3}, DType::i32);
  fill_(t, 5);
  for (double v : t.to_vector()) CHECK(v == 5);
  Tensor src = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, DType::i32);
  copy_(t, src);
  CHECK(t.to_vector() == src.to_vector());
  CHECK_FALSE(t.same_storage(src));
  CHECK_THROWS_WITH(copy_(t, zeros({3, 2}, DType::i32)), Catch::Contains("copy_"));
  CHECK_THROWS_WITH(copy_(t, zeros({2, 3}, DType::f32)), Catch::Contains("copy_"));
}

TEST_CASE("tensor: copy_ between overlapping aliases behaves like memmove", "[core][tensor]") {
  Tensor base = from_vector({0, 1, 2, 3, 4, 5}, {6}, DType::f32);
  copy_(alias(base, {4}, 2), alias(base, {4}, 0));
  CHECK(base.to_vector() == std::vector<double>{0, 1, 0, 1, 2, 3});
}

TEST_CASE("tensor: in-place helpers refuse graph tensors while grad mode is on", "[core][tensor][errors]") {
  Tensor w = zeros({3}, DType::f32);
  w.set_requires_grad(true);
  CHECK_THROWS_WITH(fill_(w, 1.0), Catch::Contains("fill_") && Catch::Contains("NoGradGuard"));
  CHECK_THROWS_WITH(copy_(w, ones({3})), Catch::Contains("copy_") && Catch::Contains("NoGradGuard"));
  {
    NoGradGuard guard;
    fill_(w, 1.0);
    copy_(w, full({3}, 2.0));
  }
  CHECK(w.to_vector() == std::vector<double>{2, 2, 2});
}

TEST_CASE("tensor: reshape method views the same storage", "[core][tensor]") {
  Tensor t = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, DType::f64);
  Tensor r = t.reshape({3, 2});
  CHECK(r.shape() == Shape{3, 2});
  CHECK(r.same_storage(t));
  CHECK(r.to_vector() == t.to_vector());
}

TEST_CASE("tensor: describe names dtype, shape and device", "[core][tensor]") {
  CHECK(describe(zeros({3, 4})) == "f32[3, 4] cpu");
  CHECK(describe(zeros({}, DType::bf16)) == "bf16[] cpu");
  CHECK(describe(arange(2)) == "i64[2] cpu");
}

TEST_CASE("tensor: CUDA storage, fill, dtype conversion and the caching allocator", "[core][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor f = full({1000}, 2.5, DType::f32, kCuda);
  CHECK(f.is_cuda());
  for (double v : f.to_vector()) REQUIRE(v == 2.5);
  Tensor z = zeros({3, 5}, DType::bf16, kCuda);
  for (double v : z.to_vector()) REQUIRE(v == 0.0);
  // Conversions on the device give the CPU's bits (bf16 rounds to nearest even).
  Tensor x = randn({4099}, DType::f32, 3);
  for (DType t : {DType::bf16, DType::f64, DType::i32, DType::i64}) {
    INFO(dtype_name(t));
    CHECK(moetrain::testing::bitwise_equal(x.to(kCuda).to(t).to(kCpu), x.to(t)));
  }
  // Freed blocks are reused: a second tensor of the same size costs no cudaMalloc.
  cuda::MemoryStats before = cuda::memory_stats(0);
  { Tensor a = empty({1 << 20}, DType::f32, kCuda); }
  cuda::MemoryStats mid = cuda::memory_stats(0);
  { Tensor b = empty({1 << 20}, DType::f32, kCuda); }
  cuda::MemoryStats after = cuda::memory_stats(0);
  CHECK(after.num_device_allocs == mid.num_device_allocs);
  CHECK(after.num_cache_hits == mid.num_cache_hits + 1);
  CHECK(after.allocated_bytes == before.allocated_bytes);
  // A request beyond the device names the request and the device.
  CHECK_THROWS_WITH(empty({int64_t{1} << 42}, DType::f32, kCuda),
                    Catch::Contains("CUDA out of memory on cuda:0") && Catch::Contains("bytes"));
}

TEST_CASE("tensor: write_pointers puts a host array of pointers in device memory", "[core][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  // 300 values: two full batches of 128 kernel arguments and a partial one.
  std::vector<const void*> values(300);
  for (size_t i = 0; i < values.size(); ++i) values[i] = reinterpret_cast<const void*>(0x1000 + 16 * i);
  Tensor out = zeros({static_cast<int64_t>(values.size())}, DType::i64, kCuda);
  cuda::write_pointers(static_cast<void* const*>(out.raw_data()), values.data(), static_cast<int64_t>(values.size()), 0);
  std::fill(values.begin(), values.end(), nullptr);  // the host array may change at once
  std::vector<double> got = out.to(kCpu).to_vector();
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == static_cast<double>(0x1000 + 16 * i));
}

TEST_CASE("tensor: asking for a CUDA tensor without a GPU is a clear error", "[core]") {
  if (cuda::device_count() > 0) return;  // a GPU machine runs the [cuda] case above instead
  std::string msg = moetrain::testing::error_of([] { empty({2}, DType::f32, kCuda); });
  if (cuda::built_with_cuda())
    CHECK_THAT(msg, Catch::Contains("cuda:0 requested but 0 CUDA device(s) are visible"));
  else
    CHECK_THAT(msg, Catch::Contains("built without CUDA"));
}
