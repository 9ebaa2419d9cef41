// The last kernels a bf16 GPT-2 step widened on the CPU (issue 38), now with a bf16
// path of their own: LayerNorm and the fused residual add + LayerNorm widen a row at a
// time into per-thread f32 rows and round each output row once (ops/common/bf16_rows.h);
// sum_to (the position embedding's gradient, MLA's shared rope key, bias gradients)
// reads bf16 values widened and rounds each sum once; dropout (GPT-2's, when
// model.dropout > 0) rounds each widened product once. Instead of cpu::run_kernel's
// whole-tensor widening. And the biased linears' passes around oneDNN's f32 product
// (bias, GELU, GELU's derivative, the bias gradient), which read grad_y and z as stored
// instead of widened copies.
//
// Checked, forward and backward, weight and bias present or absent:
//  - the same bits as the widening route (widen_bf16, the f32 kernel, round_into_bf16):
//    the same f32 arithmetic in the same order, rounded once; mean and rstd (f32) bit
//    for bit;
//  - odd shapes (widths not multiples of the vector width, rows not multiples of the
//    kernel's row grain, one row, width 1) and a million values, so that a result one f32
//    ulp off would show in some bf16 rounding;
//  - values of two magnitudes (±2^20 among randn values), so that a sum taken in another
//    order than the f32 kernel's changes the result;
//  - the same bits at 1 and 2 threads.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "backend/cpu/onednn.h"
#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/bf16_rows_fixtures.h"
#include "ops/common/bf16_widen.h"
#include "ops/dropout/dropout_kernels.h"
#include "ops/elementwise/elementwise_kernels.h"
#include "ops/linalg/linalg_kernels.h"
#include "ops/norm/norm_kernels.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bf16_rnd;
using moetrain::testing::bf16_rounded;
using moetrain::testing::bf16_spread;
using moetrain::testing::bf16_widened;
using moetrain::testing::bitwise_equal;

namespace {

struct LnRun {
  Tensor h, y, mean, rstd, dx, dw, db;
};

// LayerNorm's forward (d undefined) or the fused add + LayerNorm's; mean and rstd in
// f32 for either x (bf16: the kernel's own path; f32: the widening route's f32 kernel).
LnRun ln_forward(const Tensor& x, const Tensor& d, const Tensor& w, const Tensor& b) {
  LnRun r;
  const Shape stats = x.shape().drop_last();
  r.y = empty_like(x);
  r.mean = empty(stats, DType::f32);
  r.rstd = empty(stats, DType::f32);
  if (d.defined()) {
    r.h = empty_like(x);
    cpu::add_layer_norm_forward(r.h, r.y, r.mean, r.rstd, x, d, w, b, 1e-5);
  } else {
    cpu::layer_norm_forward(r.y, r.mean, r.rstd, x, w, b, 1e-5);
  }
  return r;
}
// The backward with dy (and grad_h = gh when fused), reading back_h (the fused op's
// saved h; x for plain LayerNorm) and the statistics mean, rstd.
void ln_backward(LnRun& r, bool fused, const Tensor& back_h, const Tensor& gh, const Tensor& dy, const Tensor& w,
                 const Tensor& b, const Tensor& mean, const Tensor& rstd) {
  r.dx = empty_like(back_h);
  if (w.defined()) r.dw = empty_like(w);
  if (b.defined()) r.db = empty_like(b);
  Tensor* dw = w.defined() ? &r.dw : nullptr;
  Tensor* db = b.defined() ? &r.db : nullptr;
  if (fused)
    cpu::add_layer_norm_backward(r.dx, dw, db, gh, dy, back_h, w, mean, rstd);
  else
    cpu::layer_norm_backward(r.dx, dw, db, dy, back_h, w, mean, rstd);
}

// The bf16 kernels against the f32 kernels on the widened values, rounded once.
void check_layer_norm_bits(const Tensor& x, const Tensor& d, const Tensor& w, const Tensor& b, const Tensor& gh,
                           const Tensor& dy) {
  const bool fused = d.defined();
  LnRun native = ln_forward(x, d, w, b);
  LnRun wide = ln_forward(bf16_widened(x), bf16_widened(d), bf16_widened(w), bf16_widened(b));
  REQUIRE(native.y.dtype() == DType::bf16);
  CHECK(bitwise_equal(native.y, bf16_rounded(wide.y)));
  CHECK(bitwise_equal(native.mean, wide.mean));
  CHECK(bitwise_equal(native.rstd, wide.rstd));
  if (fused) CHECK(bitwise_equal(native.h, bf16_rounded(wide.h)));
  // The backward reads the saved h (the fused op) or x: the bf16 one on both sides (the
  // widened kernel's f32 h holds the bf16 h's values only where the sum was exact).
  const Tensor back_h = fused ? native.h : x;
  ln_backward(native, fused, back_h, gh, dy, w, b, native.mean, native.rstd);
  ln_backward(wide, fused, bf16_widened(back_h), bf16_widened(gh), bf16_widened(dy), bf16_widened(w), bf16_widened(b),
              native.mean, native.rstd);
  REQUIRE(native.dx.dtype() == DType::bf16);
  CHECK(bitwise_equal(native.dx, bf16_rounded(wide.dx)));
  if (w.defined()) CHECK(bitwise_equal(native.dw, bf16_rounded(wide.dw)));
  if (b.defined()) CHECK(bitwise_equal(native.db, bf16_rounded(wide.db)));
}


}  // namespace

TEST_CASE("bf16 cpu rows gpt2: LayerNorm row by row has the bits of the widened kernel", "[ops][bf16]") {
  for (const Shape& shape : {Shape{37, 67}, Shape{3, 5, 128}, Shape{9, 1}, Shape{1, 257}, Shape{1024, 1031}}) {
    const int64_t n = shape[shape.ndim() - 1];
    for (bool spread : {false, true}) {
      INFO(fmt::format("shape {}{}", shape, spread ? ", magnitudes spread" : ""));
      const Tensor x = spread ? bf16_spread(shape, 1) : bf16_rnd(shape, 1, 2.0);
      const Tensor dy = spread ? bf16_spread(shape, 2) : bf16_rnd(shape, 2);
      const Tensor w = bf16_rnd({n}, 3, 0.5), b = bf16_rnd({n}, 4, 0.1);
      INFO("weight and bias");
      check_layer_norm_bits(x, Tensor(), w, b, Tensor(), dy);
      INFO("weight only");
      check_layer_norm_bits(x, Tensor(), w, Tensor(), Tensor(), dy);
      INFO("neither");
      check_layer_norm_bits(x, Tensor(), Tensor(), Tensor(), Tensor(), dy);
    }
  }
}

TEST_CASE("bf16 cpu rows gpt2: the fused residual add + LayerNorm row by row has the bits of the widened kernel",
          "[ops][bf16]") {
  for (const Shape& shape : {Shape{4, 33, 256}, Shape{13, 71}, Shape{2, 1}, Shape{1024, 1031}}) {
    const int64_t n = shape[shape.ndim() - 1];
    for (bool spread : {false, true}) {
      INFO(fmt::format("shape {}{}", shape, spread ? ", magnitudes spread" : ""));
      const Tensor x = spread ? bf16_spread(shape, 10) : bf16_rnd(shape, 10, 3.0);
      const Tensor d = bf16_rnd(shape, 11);
      const Tensor gh = spread ? bf16_spread(shape, 12) : bf16_rnd(shape, 12);
      const Tensor gy = bf16_rnd(shape, 13);
      const Tensor w = bf16_rnd({n}, 14, 0.7), b = bf16_rnd({n}, 15, 0.2);
      INFO("weight and bias");
      check_layer_norm_bits(x, d, w, b, gh, gy);
      INFO("neither");
      check_layer_norm_bits(x, d, Tensor(), Tensor(), gh, gy);
    }
  }
}

TEST_CASE("bf16 cpu rows gpt2: LayerNorm gives the same bits at 1 and 2 threads", "[ops][bf16]") {
  moetrain::testing::ThreadCountGuard guard;
  const Tensor x = bf16_spread({45, 130}, 40), d = bf16_rnd({45, 130}, 41);
  const Tensor w = bf16_rnd({130}, 42), b = bf16_rnd({130}, 43);
  const Tensor gh = bf16_rnd({45, 130}, 44), dy = bf16_spread({45, 130}, 45);
  auto run = [&](bool fused) {
    LnRun r = ln_forward(x, fused ? d : Tensor(), w, b);
    ln_backward(r, fused, fused ? r.h : x, gh, dy, w, b, r.mean, r.rstd);
    return r;
  };
  for (bool fused : {false, true}) {
    INFO((fused ? "add + LayerNorm" : "LayerNorm"));
    cpu::set_num_threads(1);
    const LnRun one = run(fused);
    cpu::set_num_threads(2);
    const LnRun two = run(fused);
    for (auto [a, c] : {std::pair{one.y, two.y}, {one.mean, two.mean}, {one.rstd, two.rstd}, {one.dx, two.dx},
                        {one.dw, two.dw}, {one.db, two.db}})
      CHECK(bitwise_equal(a, c));
    if (fused) CHECK(bitwise_equal(one.h, two.h));
  }
}

TEST_CASE("bf16 cpu rows gpt2: bf16 x with bf16 statistics is refused, naming them", "[ops][bf16]") {
  const Tensor x = bf16_rnd({4, 8}, 50);
  Tensor y = empty_like(x), mean = empty({4}, DType::bf16), rstd = empty({4}, DType::f32);
  const std::string e =
      moetrain::testing::error_of([&] { cpu::layer_norm_forward(y, mean, rstd, x, Tensor(), Tensor(), 1e-5); });
  CHECK_THAT(e, Catch::Contains("layer_norm_forward") && Catch::Contains("f32 statistics") && Catch::Contains("bf16"));
}

TEST_CASE("bf16 cpu rows gpt2: sum_to has the bits of the widened kernel", "[ops][bf16]") {
  moetrain::testing::ThreadCountGuard guard;
  // [B, T, D] to [T, D] (the position embedding's gradient) and to [D] (a bias
  // gradient): the trailing-dims path; [B, T, H, dr] to [B, T, 1, dr] (MLA's shared
  // rope key) and [5, 7, 3] to [5, 1, 3]: the general path.
  const std::vector<std::pair<Shape, Shape>> cases = {{{4, 33, 96}, {33, 96}},  {{4, 33, 96}, {96}},
                                                      {{2, 9, 5, 24}, {2, 9, 1, 24}}, {{5, 7, 3}, {5, 1, 3}},
                                                      {{1024, 1031}, {1031}}, {{3, 1}, {1}}};
  for (const auto& [from, to] : cases) {
    for (bool spread : {false, true}) {
      INFO(fmt::format("{} to {}{}", from, to, spread ? ", magnitudes spread" : ""));
      const Tensor g = spread ? bf16_spread(from, 60) : bf16_rnd(from, 60, 3.0);
      Tensor wide = empty(to, DType::f32);
      cpu::sum_to(wide, bf16_widened(g));
      for (int threads : {1, 2}) {
        cpu::set_num_threads(threads);
        Tensor native = empty(to, DType::bf16);
        cpu::sum_to(native, g);
        CHECK(bitwise_equal(native, bf16_rounded(wide)));
      }
    }
  }
  const std::string e = moetrain::testing::error_of([&] {
    Tensor out = empty({3}, DType::f32);
    cpu::sum_to(out, bf16_rnd({2, 3}, 61));
  });
  CHECK_THAT(e, Catch::Contains("sum_to") && Catch::Contains("differ in dtype"));
}

TEST_CASE("bf16 cpu rows gpt2: dropout has the bits of the widened kernel", "[ops][bf16]") {
  moetrain::testing::ThreadCountGuard guard;
  const Tensor x = bf16_spread({37, 129}, 70);
  const Generator gen(1234);
  for (double p : {0.1, 0.5, 0.9}) {
    INFO("p " << p);
    Tensor wide = empty(x.shape(), DType::f32);
    cpu::dropout_apply(wide, bf16_widened(x), p, gen, 77);
    for (int threads : {1, 2}) {
      cpu::set_num_threads(threads);
      Tensor native = empty(x.shape(), DType::bf16);
      cpu::dropout_apply(native, x, p, gen, 77);
      CHECK(bitwise_equal(native, bf16_rounded(wide)));
    }
  }
}

namespace {
// The f32 product the bf16 linear's passes start from: oneDNN's bf16 x bf16 -> f32, a
// [rows, n] = a [rows, k] b^T (b [n, k]) or a b (b [k, n]).
Tensor ln16_product(const Tensor& a, const Tensor& b, bool trans_b) {
  const int64_t rows = a.size(0), k = a.size(1), n = trans_b ? b.size(0) : b.size(1);
  Tensor c = empty({rows, n}, DType::f32);
  cpu::onednn::MatmulShape s;
  s.trans_b = trans_b, s.m = rows, s.n = n, s.k = k, s.lda = k, s.ldb = b.size(1), s.ldc = n;
  cpu::onednn::matmul(s, DType::bf16, a.data<bf16>(), b.data<bf16>(), DType::f32, c.data<float>());
  return c;
}
}  // namespace

TEST_CASE("bf16 cpu rows gpt2: linear's bias, GELU and bias-gradient passes have the bits of the f32 passes",
          "[ops][bf16]") {
  // The passes read the bf16 tensors as stored: against the f32 arithmetic on widened
  // copies (forward: the f32 add and gelu_tanh ops on oneDNN's f32 product; backward:
  // the f32 kernel's bias gradient, which no GEMM touches), each rounded once.
  moetrain::testing::ThreadCountGuard guard;
  struct Case {
    int64_t rows, in, out;
  };
  for (const Case c : {Case{37, 48, 67}, Case{256, 64, 300}, Case{1, 16, 1}}) {
    const Tensor x = bf16_rnd({c.rows, c.in}, 80), w = bf16_rnd({c.out, c.in}, 81, 0.2);
    const Tensor b = bf16_rnd({c.out}, 82), gy = bf16_spread({c.rows, c.out}, 83);
    const Tensor acc = ln16_product(x, w, true);
    for (Activation act : {Activation::none, Activation::gelu_tanh}) {
      const bool gelu = act == Activation::gelu_tanh;
      INFO(fmt::format("rows {} in {} out {}{}", c.rows, c.in, c.out, gelu ? ", GELU" : ""));
      for (int threads : {1, 2}) {
        cpu::set_num_threads(threads);
        Tensor y = empty({c.rows, c.out}, DType::bf16), z = gelu ? empty_like(y) : Tensor();
        cpu::linear_forward(y, z, x, w, b, act);
        const Tensor z_ref = add(acc, bf16_widened(b));
        CHECK(bitwise_equal(y, bf16_rounded(gelu ? gelu_tanh(z_ref) : z_ref)));
        if (gelu) CHECK(bitwise_equal(z, bf16_rounded(z_ref)));

        Tensor gx = empty_like(x), gw = empty_like(w), gb = empty_like(b);
        cpu::linear_backward(gx, gw, gb, gy, x, w, z, act);
        Tensor fx = empty(x.shape(), DType::f32), fw = empty(w.shape(), DType::f32), fb = empty({c.out}, DType::f32);
        cpu::linear_backward(fx, fw, fb, bf16_widened(gy), bf16_widened(x), bf16_widened(w), bf16_widened(z), act);
        CHECK(bitwise_equal(gb, bf16_rounded(fb)));
      }
    }
    // GELU's input gradient (mlp_gelu's backward): grad_b from oneDNN's f32 product
    // gy w against the f32 kernel's GELU column pass on that product.
    Tensor y = empty({c.rows, c.out}, DType::bf16), z = empty_like(y);
    cpu::linear_forward(y, z, x, w, b, Activation::gelu_tanh);
    const Tensor g2 = bf16_spread({c.rows, c.in}, 84);
    const Tensor w2 = bf16_rnd({c.in, c.out}, 85, 0.2);  // [in2, out2]: z is the second layer's input
    const Tensor grad_m = ln16_product(g2, w2, false);
    Tensor gz = empty_like(z), gb = empty_like(b);
    cpu::gelu_input_backward(gz, gb, g2, w2, z);
    Tensor fx = empty({c.rows, 1}, DType::f32), fw, fb = empty({c.out}, DType::f32);
    const Tensor one_w = zeros({c.out, 1}, DType::f32);  // linear_backward's GEMMs unused: only grad_b is read
    cpu::linear_backward(fx, fw, fb, grad_m, zeros({c.rows, 1}, DType::f32), one_w, bf16_widened(z),
                         Activation::gelu_tanh);
    CHECK(bitwise_equal(gb, bf16_rounded(fb)));
  }
}
