// The body of the CUDA index_select backward (ops/view/view_simt.h), run on the
// host block by block in the natural, reversed and shuffled thread orders,
// against cpu::index_select_backward: f32 and f64 bit for bit (both add a row's
// upstream rows in index order, from zero); bf16 (moetrain::bf16 storage) equal
// to the f32 sum rounded once. Embedding-like shapes (outer 1, many repeated
// ids, a vocabulary most ids never name), outer > 1, inner 1, both ways of
// making the plan. The [cuda] cases run the kernel itself.
#include <catch2/catch.hpp>

#include <vector>

#include "moetrain.h"
#include "ops/simt_orders.h"
#include "ops/view/view_kernels.h"
#include "ops/view/view_simt.h"
#include "testing.h"

using namespace moetrain;

namespace {

struct IndexCase {
  int64_t outer, n, mid, inner;
};

// n indices in [0, mid) with repeats: a few "frequent" rows and a random rest.
Tensor make_index(const IndexCase& c, DType dt, uint64_t seed) {
  Tensor r = randint({c.n}, c.mid, DType::i64, default_generator());
  std::vector<double> v = r.to(DType::f64).to_vector();
  for (int64_t i = 0; i < c.n; i += 3) v[static_cast<size_t>(i)] = static_cast<double>((seed + i / 3 % 4) % c.mid);
  return from_vector(v, {c.n}, DType::f64).to(dt);
}

template <class T>
std::vector<T> storage_of(const Tensor& t) {
  std::vector<double> v = t.to(DType::f64).to_vector();
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) simt::acc_store(out[i], static_cast<simt::acc_of_t<T>>(v[i]));
  return out;
}

// The body over every block of `threads`, from a zero gradient.
template <class T, class I>
std::vector<T> run_body(const IndexCase& c, const Tensor& index, const Tensor& grad_out, int threads,
                        simt::HostOrder order) {
  const simt::IndexAddPlan plan = simt::index_add_plan(index.data<I>(), c.n, c.mid);
  std::vector<T> g = storage_of<T>(grad_out), gx(static_cast<size_t>(c.outer * c.mid * c.inner));
  const simt::IndexAddArgs<T> a{gx.data(),    g.data(), plan.rows(), plan.offsets(), plan.positions(),
                                c.outer,      c.n,      c.mid,       c.inner,        plan.U};
  const simt::HostBlock blk = testing::host_block(threads, order);
  for (int64_t first = 0; first < a.elements(); first += threads) simt::index_add_block(blk, a, first);
  return gx;
}

std::vector<double> as_f64(const std::vector<float>& v) { return {v.begin(), v.end()}; }
std::vector<double> as_f64(const std::vector<moetrain::bf16>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = v[i].to_float();
  return d;
}

// cpu::index_select_backward from zero in dt.
Tensor cpu_backward(const IndexCase& c, const Tensor& index, const Tensor& grad_out, DType dt) {
  Tensor gx = zeros({c.outer, c.mid, c.inner}, dt);
  Tensor g = grad_out.to(dt);
  cpu::index_select_backward(gx, g, index, c.outer, c.inner);
  return gx;
}

const IndexCase kCases[] = {
    {1, 300, 1000, 67},  // an embedding: most rows never named
    {1, 97, 11, 33},     // every row named, many times
    {3, 40, 33, 35},     // outer > 1 (index_select along a middle dim)
    {1, 200, 5000, 1},   // inner 1 over a long flat tensor: the sorted plan
    {2, 1, 4, 130},      // one index
};

}  // namespace

TEST_CASE("index_select backward: the plan lists each named row's positions in order", "[ops][view][simt]") {
  for (int64_t mid : {7, 100000}) {  // the counting and the sorted plan
    std::vector<int64_t> idx{5, 2, 5, 0, 2, 5};
    const simt::IndexAddPlan p = simt::index_add_plan(idx.data(), 6, mid);
    CHECK(p.U == 3);
    CHECK(std::vector<int64_t>(p.rows(), p.rows() + 3) == std::vector<int64_t>{0, 2, 5});
    CHECK(std::vector<int64_t>(p.offsets(), p.offsets() + 4) == std::vector<int64_t>{0, 1, 3, 6});
    CHECK(std::vector<int64_t>(p.positions(), p.positions() + 6) == std::vector<int64_t>{3, 1, 4, 0, 2, 5});
  }
}

TEST_CASE("index_select backward: the CUDA body, run on the host, matches the CPU kernel", "[ops][view][simt]") {
  for (const IndexCase& c : kCases)
    for (int threads : {1, 32, 128})
      for (DType it : {DType::i32, DType::i64})
        DYNAMIC_SECTION("outer " << c.outer << " n " << c.n << " mid " << c.mid << " inner " << c.inner
                                 << " threads " << threads << " " << fmt::format("{}", it)) {
          const Tensor index = make_index(c, it, 7);
          const Tensor g = randn({c.outer, c.n, c.inner}, DType::f64, 11);
          auto body = [&](auto tag, simt::HostOrder o) {
            using T = decltype(tag);
            return it == DType::i32 ? run_body<T, int32_t>(c, index, g, threads, o)
                                    : run_body<T, int64_t>(c, index, g, threads, o);
          };
          // f64 and f32: the same additions in the same order as the CPU kernel.
          const std::vector<double> got64 = testing::run_in_all_orders([&](simt::HostOrder o) { return body(0.0, o); });
          CHECK(testing::same_bits(got64, cpu_backward(c, index, g, DType::f64).to_vector()));
          const std::vector<float> got32 = testing::run_in_all_orders([&](simt::HostOrder o) { return body(0.0f, o); });
          CHECK(testing::same_bits(as_f64(got32), cpu_backward(c, index, g, DType::f32).to(DType::f64).to_vector()));
          // bf16: the f32 sum of the bf16 values, rounded once.
          const Tensor gb = g.to(DType::bf16).to(DType::f32);
          const std::vector<moetrain::bf16> got16 =
              testing::run_in_all_orders([&](simt::HostOrder o) { return body(moetrain::bf16{}, o); });
          const Tensor want16 = cpu_backward(c, index, gb, DType::f32).to(DType::bf16).to(DType::f64);
          CHECK(testing::same_bits(as_f64(got16), want16.to_vector()));
        }
}

TEST_CASE("index_select backward: CUDA sums in f32 and rounds once (bf16), bit for bit (f32, f64)",
          "[ops][view][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  for (const IndexCase& c : kCases)
    DYNAMIC_SECTION("outer " << c.outer << " n " << c.n << " mid " << c.mid << " inner " << c.inner) {
      const Tensor index = make_index(c, DType::i64, 7);
      const Tensor g = randn({c.outer, c.n, c.inner}, DType::f64, 11);
      for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
        INFO(fmt::format("{}", dt));
        const Tensor gd = g.to(dt).to(kCuda);
        Tensor gx = zeros({c.outer, c.mid, c.inner}, dt, kCuda);
        cuda::index_select_backward(gx, gd, index, c.outer, c.inner);
        const Tensor want = dt == DType::bf16
                                ? cpu_backward(c, index, g.to(DType::bf16).to(DType::f32), DType::f32).to(DType::bf16)
                                : cpu_backward(c, index, g, dt);
        CHECK(moetrain::testing::bitwise_equal(gx.to(kCpu), want));
      }
    }
}
