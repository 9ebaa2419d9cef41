// The CPU kernels of the MoE layer and of k3's norms with a bf16 path of their own
// (issue 38, the MoE layer's slice): RMSNorm / L2 norm (plain and gated), the fused
// residual add + RMSNorm, the MoE combine, index_select's backward (the dispatch's
// gather) and MLA's output gate (sigmoid_gate, element by element) widen a row at a time into a per-thread f32 buffer and round each output row
// once (ops/common/bf16_rows.h) instead of cpu::run_kernel's whole-tensor widening.
//
// What is checked, per kernel, forward and backward:
//  - the same bits as the widening route (widen_bf16, the f32 kernel, round_into_bf16):
//    both compute each value with the same f32 arithmetic in the same order and round
//    once; the f32 statistics (rstd) bit for bit too;
//  - odd shapes (rows and widths that are not multiples of the vector width or of the
//    kernels' thread grains), dropped slots, rows no slot or index names;
//  - the same bits at 1 and 2 threads.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/bf16_rows_fixtures.h"
#include "ops/common/bf16_widen.h"
#include "ops/elementwise/elementwise_kernels.h"
#include "ops/moe/moe_kernels.h"
#include "ops/norm/norm_kernels.h"
#include "ops/view/view_kernels.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bf16_rnd;
using moetrain::testing::bf16_rounded;
using moetrain::testing::bf16_spread;
using moetrain::testing::bf16_widened;
using moetrain::testing::bitwise_equal;

namespace {



// ---- the scaled norms (RMSNorm, L2 norm, gated RMSNorm) ----

struct NormRun {
  Tensor y, rstd, dx, dw, dz;
};

// scaled_norm forward and backward on x (bf16: the kernel's own path; f32: the widening
// route's f32 kernel). w and z may be undefined.
NormRun norm_run(const Tensor& x, const Tensor& w, const Tensor& z, const Tensor& dy, double scale) {
  NormRun r;
  r.y = empty_like(x);
  r.rstd = empty(x.shape().drop_last(), DType::f32);
  cpu::scaled_norm_forward(r.y, r.rstd, x, w, z, scale, 1e-6);
  r.dx = empty_like(x);
  if (w.defined()) r.dw = empty_like(w);
  if (z.defined()) r.dz = empty_like(z);
  cpu::scaled_norm_backward(r.dx, w.defined() ? &r.dw : nullptr, z.defined() ? &r.dz : nullptr, dy, x, w, z, r.rstd,
                            scale);
  return r;
}

void check_norm_bits(const Tensor& x, const Tensor& w, const Tensor& z, const Tensor& dy, double scale) {
  const NormRun native = norm_run(x, w, z, dy, scale);
  const NormRun wide = norm_run(bf16_widened(x), bf16_widened(w), bf16_widened(z), bf16_widened(dy), scale);
  CHECK(native.y.dtype() == DType::bf16);
  CHECK(bitwise_equal(native.y, bf16_rounded(wide.y)));
  CHECK(bitwise_equal(native.rstd, wide.rstd));
  CHECK(bitwise_equal(native.dx, bf16_rounded(wide.dx)));
  if (w.defined()) CHECK(bitwise_equal(native.dw, bf16_rounded(wide.dw)));
  if (z.defined()) CHECK(bitwise_equal(native.dz, bf16_rounded(wide.dz)));
}

struct AddNormRun {
  Tensor h, y, rstd, dx, dw;
};

AddNormRun add_norm_run(const Tensor& x, const Tensor& d, const Tensor& w, const Tensor& gh, const Tensor& gy,
                        double scale) {
  AddNormRun r;
  r.h = empty_like(x);
  r.y = empty_like(x);
  r.rstd = empty(x.shape().drop_last(), DType::f32);
  cpu::add_scaled_norm_forward(r.h, r.y, r.rstd, x, d, w, scale, 1e-5);
  r.dx = empty_like(x);
  if (w.defined()) r.dw = empty_like(w);
  cpu::add_scaled_norm_backward(r.dx, w.defined() ? &r.dw : nullptr, gh, gy, r.h, w, r.rstd, scale);
  return r;
}

// ---- the MoE combine ----

struct CombineRun {
  Tensor y, grad_rows, grad_weights;
};

// N tokens of k slots over M = N k + 3 rows of width W; slot i = n k + s names row
// (7919 i + 11) mod N k, or M (dropped) for every fifth slot; rows no slot names (the
// last 3 and those of the dropped slots) are left in grad_rows as they were (the op's
// zeros; a marker in the test to see they stay).
struct CombineCase {
  int64_t M = 0, N = 0, k = 0, W = 0;
  Tensor slot_rows;
};

CombineCase combine_case(int64_t N, int64_t k, int64_t W) {
  CombineCase c;
  c.N = N, c.k = k, c.W = W, c.M = N * k + 3;  // 3 rows named by no slot
  std::vector<double> idx(static_cast<size_t>(N * k));
  for (int64_t i = 0; i < N * k; ++i)
    idx[static_cast<size_t>(i)] = static_cast<double>(i % 5 == 2 ? c.M : (i * 7919 + 11) % (N * k));
  // Every row named by at most one slot (moe_combine checks it; the kernels' row writes
  // rely on it): 7919 is a prime that divides no N k here.
  std::vector<int> named(static_cast<size_t>(c.M + 1), 0);
  int64_t twice = 0;
  for (double r : idx) twice += r != static_cast<double>(c.M) && ++named[static_cast<size_t>(r)] > 1;
  REQUIRE(twice == 0);
  c.slot_rows = from_vector(idx, {N * k}, DType::i64);
  return c;
}

CombineRun combine_run(const CombineCase& c, const Tensor& rows, const Tensor& weights, const Tensor& dy,
                       const Tensor& grad_rows_in) {
  CombineRun r;
  r.y = empty({c.N, c.W}, rows.dtype());
  cpu::moe_combine_forward(r.y, rows, c.slot_rows, weights);
  r.grad_rows = grad_rows_in.clone();
  r.grad_weights = empty({c.N, c.k}, rows.dtype());
  cpu::moe_combine_backward(r.grad_rows, r.grad_weights, dy, rows, c.slot_rows, weights);
  return r;
}

// ---- sigmoid_gate (MLA's output gate) ----

struct GateRun {
  Tensor y, dx, dz;
};

// Forward, and backward with both gradients or one (which: 0 both, 1 dx only, 2 dz only).
GateRun gate_run(const Tensor& x, const Tensor& z, const Tensor& dy, int which) {
  GateRun r;
  r.y = empty_like(x);
  cpu::sigmoid_gate_forward(r.y, x, z);
  if (which != 2) r.dx = empty_like(x);
  if (which != 1) r.dz = empty_like(z);
  cpu::sigmoid_gate_backward(r.dx.defined() ? &r.dx : nullptr, r.dz.defined() ? &r.dz : nullptr, dy, x, z);
  return r;
}

// ---- index_select's backward ----

Tensor index_of(const std::vector<int64_t>& v) {
  std::vector<double> d(v.begin(), v.end());
  return from_vector(d, {static_cast<int64_t>(v.size())}, DType::i64);
}

Tensor index_backward_run(const Tensor& grad_x_in, const Tensor& grad_out, const Tensor& index, int64_t outer,
                          int64_t inner) {
  Tensor gx = grad_x_in.clone();
  cpu::index_select_backward(gx, grad_out, index, outer, inner);
  return gx;
}

}  // namespace

TEST_CASE("bf16 cpu rows moe: RMSNorm, L2 norm and gated RMSNorm row by row have the bits of the widened kernel",
          "[ops][bf16]") {
  // [1024, 1031]: a million values, so that a result one f32 ulp off shows in some
  // bf16 rounding (about 2 in 2^16 values sit that close to a rounding boundary).
  for (const Shape& shape : {Shape{37, 67}, Shape{3, 5, 128}, Shape{9, 1}, Shape{1, 257}, Shape{1024, 1031}}) {
    const int64_t n = shape[shape.ndim() - 1];
    const Tensor x = bf16_rnd(shape, 1, 2.0), dy = bf16_rnd(shape, 2);
    const Tensor w = bf16_rnd({n}, 3, 0.5), z = bf16_rnd(shape, 4, 3.0);
    INFO(fmt::format("shape {}", shape));
    INFO("rms_norm");
    check_norm_bits(x, w, Tensor(), dy, 1.0 / static_cast<double>(n));
    INFO("l2_norm: no weight, scale 1");
    check_norm_bits(x, Tensor(), Tensor(), dy, 1.0);
    INFO("gated rms_norm");
    check_norm_bits(x, w, z, dy, 1.0 / static_cast<double>(n));
    INFO("gated, no weight");
    check_norm_bits(x, Tensor(), z, dy, 1.0 / static_cast<double>(n));
  }
}

TEST_CASE("bf16 cpu rows moe: a bf16 gate under f32 x still reads as the widened gate", "[ops][bf16]") {
  // KDA's gated RMSNorm: f32 o, bf16 gate z (ops/norm/norm.cpp); z widened, dz rounded once.
  const Tensor x = randn({11, 2, 64}, DType::f32, 5), dy = randn({11, 2, 64}, DType::f32, 6);
  const Tensor w = randn({64}, DType::f32, 7), z = bf16_rnd({11, 2, 64}, 8, 2.0);
  const NormRun mixed = norm_run(x, w, z, dy, 1.0 / 64);
  const NormRun wide = norm_run(x, w, bf16_widened(z), dy, 1.0 / 64);
  CHECK(bitwise_equal(mixed.y, wide.y));
  CHECK(bitwise_equal(mixed.rstd, wide.rstd));
  CHECK(bitwise_equal(mixed.dx, wide.dx));
  CHECK(bitwise_equal(mixed.dw, wide.dw));
  REQUIRE(mixed.dz.dtype() == DType::bf16);
  CHECK(bitwise_equal(mixed.dz, bf16_rounded(wide.dz)));
}

TEST_CASE("bf16 cpu rows moe: the fused residual add + RMSNorm row by row has the bits of the widened kernel",
          "[ops][bf16]") {
  for (const Shape& shape : {Shape{4, 33, 256}, Shape{13, 71}, Shape{2, 1}, Shape{1024, 1031}}) {
    const int64_t n = shape[shape.ndim() - 1];
    INFO(fmt::format("shape {}", shape));
    const Tensor x = bf16_rnd(shape, 10, 3.0), d = bf16_rnd(shape, 11);
    const Tensor gh = bf16_rnd(shape, 12), gy = bf16_rnd(shape, 13);
    for (bool weighted : {true, false}) {
      const Tensor w = weighted ? bf16_rnd({n}, 14, 0.7) : Tensor();
      const AddNormRun native = add_norm_run(x, d, w, gh, gy, 1.0 / static_cast<double>(n));
      const AddNormRun wide = add_norm_run(bf16_widened(x), bf16_widened(d), bf16_widened(w), bf16_widened(gh),
                                           bf16_widened(gy), 1.0 / static_cast<double>(n));
      CHECK(bitwise_equal(native.h, bf16_rounded(wide.h)));
      CHECK(bitwise_equal(native.y, bf16_rounded(wide.y)));
      CHECK(bitwise_equal(native.rstd, wide.rstd));
      // The backward reads h: the widened kernel's f32 h is the bf16 h's values only where
      // the sum was exact, so both backward passes run on the (same) bf16 h.
      AddNormRun wide_back = wide;
      wide_back.dx = empty(shape, DType::f32);
      if (weighted) wide_back.dw = empty({n}, DType::f32);
      cpu::add_scaled_norm_backward(wide_back.dx, weighted ? &wide_back.dw : nullptr, bf16_widened(gh),
                                    bf16_widened(gy), bf16_widened(native.h), bf16_widened(w), native.rstd,
                                    1.0 / static_cast<double>(n));
      CHECK(bitwise_equal(native.dx, bf16_rounded(wide_back.dx)));
      if (weighted) CHECK(bitwise_equal(native.dw, bf16_rounded(wide_back.dw)));
    }
  }
}

TEST_CASE("bf16 cpu rows moe: the MoE combine token by token has the bits of the widened kernel", "[ops][bf16]") {
  struct Dims {
    int64_t N, k, W;
  };
  for (const Dims& s : {Dims{37, 3, 67}, Dims{64, 8, 128}, Dims{5, 1, 9}, Dims{1024, 8, 131}})
    for (bool spread : {false, true}) {
    INFO("N " << s.N << " k " << s.k << " W " << s.W << (spread ? ", magnitudes spread" : ""));
    const CombineCase c = combine_case(s.N, s.k, s.W);
    const Tensor rows = spread ? bf16_spread({c.M, c.W}, 20) : bf16_rnd({c.M, c.W}, 20, 2.0);
    const Tensor weights = bf16_rnd({c.N, c.k}, 21, 0.3);
    const Tensor dy = spread ? bf16_spread({c.N, c.W}, 22) : bf16_rnd({c.N, c.W}, 22);
    // Rows no slot names keep what grad_rows held (the op's zeros; a marker here).
    const Tensor grad_rows_in = bf16_rnd({c.M, c.W}, 23);
    const CombineRun native = combine_run(c, rows, weights, dy, grad_rows_in);
    const CombineRun wide =
        combine_run(c, bf16_widened(rows), bf16_widened(weights), bf16_widened(dy), bf16_widened(grad_rows_in));
    CHECK(native.y.dtype() == DType::bf16);
    CHECK(bitwise_equal(native.y, bf16_rounded(wide.y)));
    CHECK(bitwise_equal(native.grad_rows, bf16_rounded(wide.grad_rows)));
    CHECK(bitwise_equal(native.grad_weights, bf16_rounded(wide.grad_weights)));
    // The unnamed rows (the last 3) are untouched; the dropped slots' weight gradients are 0.
    CHECK(bitwise_equal(slice(native.grad_rows, 0, c.M - 3, c.M), slice(grad_rows_in, 0, c.M - 3, c.M)));
    CHECK(native.grad_weights.to_vector()[2] == 0.0);
  }
}

TEST_CASE("bf16 cpu rows moe: index_select's backward row by row has the bits of the widened kernel",
          "[ops][bf16]") {
  // Repeated indices (their rows summed in index order), rows named by none, outer 1
  // (the MoE dispatch's gather: rows of z) and outer > 1.
  const std::vector<int64_t> idx = {4, 0, 4, 7, 2, 4, 0, 9, 9, 9, 1, 4, 6};
  const int64_t n = static_cast<int64_t>(idx.size()), mid = 11;
  for (auto [outer, inner] : {std::pair<int64_t, int64_t>{1, 67}, {1, 128}, {3, 5}, {6, 1}}) {
    INFO("outer " << outer << " inner " << inner);
    const Tensor g = bf16_spread({outer, n, inner}, 30);
    for (bool zero_start : {true, false}) {
      const Tensor start = zero_start ? zeros({outer, mid, inner}, DType::bf16) : bf16_rnd({outer, mid, inner}, 31);
      const Tensor native = index_backward_run(start, g, index_of(idx), outer, inner);
      const Tensor wide = index_backward_run(bf16_widened(start), bf16_widened(g), index_of(idx), outer, inner);
      CHECK(bitwise_equal(native, bf16_rounded(wide)));
      // Row 3 is named by no index: as it was.
      CHECK(bitwise_equal(slice(native, 1, 3, 4), slice(start, 1, 3, 4)));
    }
  }
}

TEST_CASE("bf16 cpu rows moe: MLA's output gate element by element has the bits of the widened kernel",
          "[ops][bf16]") {
  for (const Shape& shape : {Shape{37, 67}, Shape{2, 3, 5}, Shape{1024, 1031}}) {
    INFO(fmt::format("shape {}", shape));
    const Tensor x = bf16_rnd(shape, 50, 2.0), z = bf16_rnd(shape, 51, 4.0), dy = bf16_rnd(shape, 52);
    for (int which : {0, 1, 2}) {
      INFO("gradients " << which);
      const GateRun native = gate_run(x, z, dy, which);
      const GateRun wide = gate_run(bf16_widened(x), bf16_widened(z), bf16_widened(dy), which);
      CHECK(native.y.dtype() == DType::bf16);
      CHECK(bitwise_equal(native.y, bf16_rounded(wide.y)));
      if (which != 2) CHECK(bitwise_equal(native.dx, bf16_rounded(wide.dx)));
      if (which != 1) CHECK(bitwise_equal(native.dz, bf16_rounded(wide.dz)));
    }
  }
}

TEST_CASE("bf16 cpu rows moe: the same bits at 1 and 2 threads", "[ops][bf16]") {
  moetrain::testing::ThreadCountGuard guard;
  const Tensor x = bf16_rnd({45, 130}, 40, 2.0), d = bf16_rnd({45, 130}, 41);
  const Tensor w = bf16_rnd({130}, 42), z = bf16_rnd({45, 130}, 43), dy = bf16_rnd({45, 130}, 44);
  const CombineCase c = combine_case(70, 4, 96);
  const Tensor rows = bf16_rnd({c.M, c.W}, 45), weights = bf16_rnd({c.N, c.k}, 46, 0.3);
  const Tensor cdy = bf16_rnd({c.N, c.W}, 47);
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < 300; ++i) idx.push_back((i * 7919) % 97);
  const Tensor g = bf16_rnd({300, 33}, 48);
  struct Run {
    NormRun gated;
    AddNormRun add;
    CombineRun combine;
    Tensor gathered;
    GateRun gate;
  };
  auto run = [&] {
    Run r;
    r.gated = norm_run(x, w, z, dy, 1.0 / 130);
    r.add = add_norm_run(x, d, w, dy, z, 1.0 / 130);
    r.combine = combine_run(c, rows, weights, cdy, zeros({c.M, c.W}, DType::bf16));
    r.gathered = index_backward_run(zeros({97, 33}, DType::bf16), g, index_of(idx), 1, 33);
    r.gate = gate_run(x, z, dy, 0);
    return r;
  };
  cpu::set_num_threads(1);
  const Run one = run();
  cpu::set_num_threads(2);
  const Run two = run();
  for (auto [a, b] : {std::pair{one.gated.y, two.gated.y}, {one.gated.dx, two.gated.dx}, {one.gated.dw, two.gated.dw},
                      {one.gated.dz, two.gated.dz}, {one.gated.rstd, two.gated.rstd}, {one.add.h, two.add.h},
                      {one.add.y, two.add.y}, {one.add.dx, two.add.dx}, {one.add.dw, two.add.dw},
                      {one.combine.y, two.combine.y}, {one.combine.grad_rows, two.combine.grad_rows},
                      {one.combine.grad_weights, two.combine.grad_weights}, {one.gathered, two.gathered},
                      {one.gate.y, two.gate.y}, {one.gate.dx, two.gate.dx}, {one.gate.dz, two.gate.dz}})
    CHECK(bitwise_equal(a, b));
}
