// The embedding's backward with device ids plans on the device (ops/view/view_simt.h):
// the positions stably sorted by id, then an uncompacted plan of n entries made by
// index_add_run_plan_element, summed by the unchanged index_add_element with U = n.
// Here the host runs the same bodies (std::stable_sort standing in for CUB's
// stable radix sort) and the result must equal index_add_plan's bit for bit (f32,
// f64, bf16: the same additions in the same order, rounded once), and a float64
// direct sum within a tolerance. Ids outside the table name no row and add
// nothing. The [cuda] case runs embedding itself with device ids against host ids.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "moetrain.h"
#include "ops/simt_orders.h"
#include "ops/view/view_kernels.h"
#include "ops/view/view_simt.h"
#include "testing.h"

using namespace moetrain;

namespace {

// The device plan made on the host: keys as index_add_keys_kernel makes them,
// positions stably sorted by key, then the plan body for each sorted position.
struct EmbRunPlan {
  std::vector<int64_t> sorted_keys, positions, rows, offsets;
};

EmbRunPlan emb_device_plan(const std::vector<int64_t>& ids, int64_t mid, bool map_keys = true) {
  const int64_t n = static_cast<int64_t>(ids.size());
  EmbRunPlan p;
  std::vector<int64_t> keys(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) keys[i] = map_keys ? simt::index_add_sort_key(ids[i], mid) : ids[i];
  p.positions.resize(ids.size());
  std::iota(p.positions.begin(), p.positions.end(), int64_t{0});
  std::stable_sort(p.positions.begin(), p.positions.end(),
                   [&](int64_t a, int64_t b) { return keys[static_cast<size_t>(a)] < keys[static_cast<size_t>(b)]; });
  for (int64_t i : p.positions) p.sorted_keys.push_back(keys[static_cast<size_t>(i)]);
  p.rows.assign(ids.size(), 7777);  // garbage: every entry must be written
  p.offsets.assign(ids.size() + 1, 7777);
  for (int64_t k = 0; k < n; ++k)
    simt::index_add_run_plan_element(p.sorted_keys.data(), n, mid, k, p.rows.data(), p.offsets.data());
  return p;
}

template <class T>
T emb_store(double v) {
  T t{};
  simt::acc_store(t, static_cast<simt::acc_of_t<T>>(v));
  return t;
}

template <class T>
double emb_load(T v) {
  return static_cast<double>(simt::acc_load(v));
}

// grad_x [outer, mid, inner] += the index-add of grad_out [outer, n, inner], every
// element of [outer, U, inner] by index_add_element.
template <class T>
void emb_index_add(std::vector<T>& gx, const std::vector<T>& g, const int64_t* rows, const int64_t* offsets,
                   const int64_t* positions, int64_t outer, int64_t n, int64_t mid, int64_t inner, int64_t U) {
  const simt::IndexAddArgs<T> a{gx.data(), g.data(), rows, offsets, positions, outer, n, mid, inner, U};
  for (int64_t e = a.elements() - 1; e >= 0; --e) simt::index_add_element(a, e);  // any order: one writer per element
}

struct EmbCase {
  int64_t outer, n, mid, inner;
  int repeats;  // 0: uniform ids; 1: a few frequent ids; 2: a single id
};

const EmbCase kEmbCases[] = {
    {1, 300, 1000, 67, 1},                // an embedding: most rows never named
    {1, 500, 4 * 500 + 4096 + 777, 9, 0}, // a vocabulary past 4n + 4096: index_add_plan's radix sort
    {1, 2000, 5, 3, 0},                   // a small vocabulary, many repeats per row
    {1, 1, 11, 40, 0},                    // one id
    {1, 129, 50, 5, 2},                   // one id repeated
    {3, 40, 33, 35, 1},                   // outer > 1
    {1, 256, 70000, 1, 1},                // inner 1, a large vocabulary
};

std::vector<int64_t> emb_ids(const EmbCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> any(0, c.mid - 1);
  const int64_t single = any(rng);
  std::vector<int64_t> ids(static_cast<size_t>(c.n));
  for (int64_t i = 0; i < c.n; ++i) {
    int64_t v = any(rng);
    if (c.repeats == 1 && i % 3 == 0) v = (static_cast<int64_t>(seed) + i / 3 % 4) % c.mid;
    if (c.repeats == 2) v = single;
    ids[static_cast<size_t>(i)] = v;
  }
  return ids;
}

// The device plan against index_add_plan (bits) and a float64 sum (tolerance),
// for grad_x starting from nonzero values (the kernel adds to it).
template <class T>
void emb_check_case(const EmbCase& c, const std::vector<int64_t>& ids, uint64_t seed, double rel_tol) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<T> g(static_cast<size_t>(c.outer * c.n * c.inner)), gx0(static_cast<size_t>(c.outer * c.mid * c.inner));
  for (T& v : g) v = emb_store<T>(normal(rng));
  for (T& v : gx0) v = emb_store<T>(normal(rng));

  const simt::IndexAddPlan host = simt::index_add_plan(ids.data(), c.n, c.mid);
  std::vector<T> want = gx0;
  emb_index_add(want, g, host.rows(), host.offsets(), host.positions(), c.outer, c.n, c.mid, c.inner, host.U);

  const EmbRunPlan dev = emb_device_plan(ids, c.mid);
  std::vector<T> got = gx0;
  emb_index_add(got, g, dev.rows.data(), dev.offsets.data(), dev.positions.data(), c.outer, c.n, c.mid, c.inner,
                c.n);
  CHECK(testing::same_bits(got, want));

  // The float64 direct sum: Σ over the positions naming each row, plus the start.
  std::vector<double> sum(gx0.size()), mag(gx0.size());
  for (size_t i = 0; i < gx0.size(); ++i) {
    sum[i] = emb_load(gx0[i]);
    mag[i] = std::abs(sum[i]);
  }
  for (int64_t o = 0; o < c.outer; ++o)
    for (int64_t i = 0; i < c.n; ++i)
      for (int64_t col = 0; col < c.inner; ++col) {
        const size_t d = static_cast<size_t>((o * c.mid + ids[static_cast<size_t>(i)]) * c.inner + col);
        const double v = emb_load(g[static_cast<size_t>((o * c.n + i) * c.inner + col)]);
        sum[d] += v;
        mag[d] += std::abs(v);
      }
  double worst = 0;
  for (size_t i = 0; i < sum.size(); ++i)
    worst = std::max(worst, std::abs(emb_load(got[i]) - sum[i]) / std::max(mag[i], 1e-300));
  INFO("worst error relative to the sum of magnitudes " << worst);
  CHECK(worst <= rel_tol);
}

}  // namespace

TEST_CASE("embedding device plan: runs of the sorted ids give each row's positions in order", "[ops][embedding]") {
  // mid 7: the key 7 is index_add_sort_key's mark for an id outside the table.
  const std::vector<int64_t> sorted{0, 0, 2, 2, 2, 5, 7};
  std::vector<int64_t> rows(7, 99), offsets(8, 99);
  for (int64_t k = 0; k < 7; ++k) simt::index_add_run_plan_element(sorted.data(), 7, 7, k, rows.data(), offsets.data());
  CHECK(rows == std::vector<int64_t>{0, -1, 2, -1, -1, 5, -1});
  CHECK(offsets == std::vector<int64_t>{0, 2, 2, 5, 5, 5, 6, 7});
  CHECK(simt::index_add_sort_key(-1, 7) == 7);
  CHECK(simt::index_add_sort_key(7, 7) == 7);
  CHECK(simt::index_add_sort_key(1 << 20, 7) == 7);
  CHECK(simt::index_add_sort_key(0, 7) == 0);
  CHECK(simt::index_add_sort_key(6, 7) == 6);
  // The same positions, in the same order, as index_add_plan's CSR.
  const std::vector<int64_t> ids{5, 2, 5, 0, 2, 5};
  const EmbRunPlan p = emb_device_plan(ids, 100000);
  CHECK(p.positions == std::vector<int64_t>{3, 1, 4, 0, 2, 5});
  CHECK(p.rows == std::vector<int64_t>{0, 2, -1, 5, -1, -1});
  CHECK(p.offsets == std::vector<int64_t>{0, 1, 3, 3, 6, 6, 6});
}

TEST_CASE("embedding device plan: the gradient equals the host plan's bit for bit", "[ops][embedding]") {
  uint64_t seed = 101;
  for (const EmbCase& c : kEmbCases)
    DYNAMIC_SECTION("outer " << c.outer << " n " << c.n << " mid " << c.mid << " inner " << c.inner << " repeats "
                             << c.repeats) {
      const std::vector<int64_t> ids = emb_ids(c, seed);
      // Tolerances against the f64 sum, relative to the sum of magnitudes: f64
      // and f32 accumulate n terms at most (n·2^-53, n·2^-24 bounds); bf16 adds
      // one rounding to 8 bits (2^-8) to the f32 sum.
      emb_check_case<double>(c, ids, seed + 1, static_cast<double>(c.n) * 0x1p-52);
      emb_check_case<float>(c, ids, seed + 2, static_cast<double>(c.n) * 0x1p-23);
      emb_check_case<moetrain::bf16>(c, ids, seed + 3, 0x1p-8 + static_cast<double>(c.n) * 0x1p-23);
      ++seed;
    }
}

TEST_CASE("embedding device plan: ids outside the table name no row and add nothing", "[ops][embedding]") {
  const int64_t mid = 9, inner = 4;
  // -1, 9 and 1000 are outside [0, 9); 3 repeats around them.
  const std::vector<int64_t> ids{3, -1, 9, 3, 1000, 0, 3, 9, 8};
  const int64_t n = static_cast<int64_t>(ids.size());
  std::vector<float> g(static_cast<size_t>(n * inner)), gx0(static_cast<size_t>(mid * inner));
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.37f * static_cast<float>(i) - 3.1f;
  for (size_t i = 0; i < gx0.size(); ++i) gx0[i] = 0.11f * static_cast<float>(i);
  // The same sums as the in-range ids alone: each row's positions in order, from
  // zero, added once.
  std::vector<float> want = gx0;
  for (int64_t r = 0; r < mid; ++r)
    for (int64_t c = 0; c < inner; ++c) {
      float acc = 0;
      bool named = false;
      for (int64_t i = 0; i < n; ++i)
        if (ids[static_cast<size_t>(i)] == r) {
          acc += g[static_cast<size_t>(i * inner + c)];
          named = true;
        }
      if (named) want[static_cast<size_t>(r * inner + c)] += acc;
    }
  for (bool map_keys : {true, false}) {  // the sort key's mark, and the raw keys (-1 sorts first)
    INFO("mapped keys " << map_keys);
    const EmbRunPlan p = emb_device_plan(ids, mid, map_keys);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t key = p.sorted_keys[static_cast<size_t>(k)];
      if (key < 0 || key >= mid) CHECK(p.rows[static_cast<size_t>(k)] == -1);
    }
    std::vector<float> got = gx0;
    emb_index_add(got, g, p.rows.data(), p.offsets.data(), p.positions.data(), 1, n, mid, inner, n);
    CHECK(testing::same_bits(got, want));
  }
}

TEST_CASE("embedding: device ids give the host ids' rows and gradient bit for bit; an id outside gives NaN",
          "[ops][embedding][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  struct Shape3 {
    int64_t V, D, B, T;
  };
  for (Shape3 s : {Shape3{1000, 67, 4, 33}, Shape3{7, 5, 3, 50}, Shape3{70000, 16, 2, 64}})
    for (DType dt : {DType::f32, DType::bf16})
      for (DType it : {DType::i32, DType::i64, DType::u16}) {
        if (it == DType::u16 && s.V > 65535) continue;
        INFO(fmt::format("V {} D {} {} ids {}", s.V, s.D, dt, it));
        Tensor ids = randint({s.B, s.T}, s.V, DType::i64, default_generator());
        std::vector<double> v = ids.to(DType::f64).to_vector();
        for (size_t i = 0; i < v.size(); i += 3) v[i] = static_cast<double>(i / 3 % 4);  // frequent rows
        ids = from_vector(v, {s.B, s.T}, DType::f64).to(it);
        const Tensor w0 = randn({s.V, s.D}, DType::f32, 5).to(dt).to(kCuda);
        const Tensor up = randn({s.B, s.T, s.D}, DType::f32, 6).to(dt).to(kCuda);
        Tensor wh = w0.detach().set_requires_grad(), wd = w0.detach().set_requires_grad();
        const Tensor yh = embedding(wh, ids), yd = embedding(wd, ids.to(kCuda));
        CHECK(moetrain::testing::bitwise_equal(yd.to(kCpu), yh.to(kCpu)));
        yh.backward(up);
        yd.backward(up);
        REQUIRE(wd.grad().defined());
        CHECK(wd.grad().is_cuda());
        CHECK(moetrain::testing::bitwise_equal(wd.grad().to(kCpu), wh.grad().to(kCpu)));
      }
  // An id outside the table: its row is NaN, the others are the table's; the
  // gradient skips it, no fault.
  const Tensor w = randn({11, 4}, DType::f32, 1).to(kCuda).set_requires_grad();
  const Tensor bad = from_vector({3, 11, 5, -1}, {4}, DType::i64).to(kCuda);
  const Tensor y = embedding(w, bad);
  const std::vector<double> vy = y.to(kCpu).to(DType::f64).to_vector();
  const std::vector<double> vw = w.detach().to(kCpu).to(DType::f64).to_vector();
  for (int c = 0; c < 4; ++c) {
    CHECK(vy[static_cast<size_t>(c)] == vw[static_cast<size_t>(3 * 4 + c)]);
    CHECK(std::isnan(vy[static_cast<size_t>(4 + c)]));
    CHECK(vy[static_cast<size_t>(8 + c)] == vw[static_cast<size_t>(5 * 4 + c)]);
    CHECK(std::isnan(vy[static_cast<size_t>(12 + c)]));
  }
  y.backward(full({4, 4}, 1.0, DType::f32, kCuda));
  const std::vector<double> gw = w.grad().to(kCpu).to(DType::f64).to_vector();
  for (int r = 0; r < 11; ++r)
    for (int c = 0; c < 4; ++c)
      CHECK(gw[static_cast<size_t>(r * 4 + c)] == (r == 3 || r == 5 ? 1.0 : 0.0));
}
