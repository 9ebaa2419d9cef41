// The CPU kernels with a bf16 path of their own (issue 38, second slice): instead of
// cpu::run_kernel's whole-tensor widening (ops/common/bf16_widen.h) they widen a row
// or block at a time into a per-thread f32 buffer and round their outputs once
// (ops/common/bf16_rows.h): cross entropy, the binary ops, SiTU-GLU, AttnRes; and causal
// attention, whose products run on oneDNN's bf16 matmul with f32 accumulation.
//
// What is checked, per kernel:
//  - (not attention, whose P and dS are bf16 operands) the same bits as the widening
//    route (widen_bf16, the f32 kernel, round_into_bf16), since both compute each
//    value with the same f32 arithmetic and round once; SiTU's
//    dβ sums per block in double, so it is compared to 1e-12 relative instead;
//  - the op on bf16 inputs against the op on the f32 copies of the same values (the
//    tolerances of tests/ops/bf16_cpu_test.cpp: 1e-2 forward, 3e-2 gradients, as
//    max |bf16 - f32| / max |f32|);
//  - the same bits at 1 and 2 threads.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "backend/cpu/onednn.h"
#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/attnres/attnres_kernels.h"
#include "ops/bf16_rows_fixtures.h"
#include "ops/common/bf16_widen.h"
#include "ops/elementwise/elementwise_kernels.h"
#include "ops/situ/situ.h"
#include "ops/situ/situ_kernels.h"
#include "ops/softmax/softmax_kernels.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bf16_rnd;
using moetrain::testing::bf16_rounded;
using moetrain::testing::bf16_widened;

namespace {

constexpr double kProductsForwardTol = 1e-2;
constexpr double kProductsBackwardTol = 3e-2;

struct CrossEntropyRun {
  Tensor lse, grad;
  double loss_sum = 0;
  int64_t count = 0;
};

// N rows of V columns (the last V - classes are padding), some rows ignored.
CrossEntropyRun cross_entropy_kernels(const Tensor& logits, const Tensor& targets, int64_t classes) {
  CrossEntropyRun r;
  const int64_t n = logits.size(0);
  r.lse = empty({n}, DType::f64);
  cpu::cross_entropy_forward(r.lse, r.loss_sum, r.count, logits, targets, -1, classes);
  r.grad = empty_like(logits);
  cpu::cross_entropy_backward(r.grad, logits, targets, r.lse, 1.0 / 7, -1, classes);
  return r;
}

Tensor cross_entropy_targets(int64_t n, int64_t classes) {
  std::vector<double> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<double>(i % 5 == 3 ? -1 : (i * 7919) % classes);
  return from_vector(t, {n}, DType::i64);
}

}  // namespace

TEST_CASE("bf16 cpu products: cross entropy row by row has the bits of the widened kernel", "[ops][bf16]") {
  const int64_t n = 37, v = 1000, classes = 990;
  const Tensor logits = bf16_rnd({n, v}, 1, 3.0);
  const Tensor targets = cross_entropy_targets(n, classes);
  const CrossEntropyRun native = cross_entropy_kernels(logits, targets, classes);
  const CrossEntropyRun wide = cross_entropy_kernels(bf16_widened(logits), targets, classes);
  CHECK(native.grad.dtype() == DType::bf16);
  CHECK(moetrain::testing::bitwise_equal(native.lse, wide.lse));
  CHECK(native.loss_sum == wide.loss_sum);  // same row values summed in the same order
  CHECK(native.count == wide.count);
  CHECK(moetrain::testing::bitwise_equal(native.grad, bf16_rounded(wide.grad)));
}

TEST_CASE("bf16 cpu products: cross entropy on bf16 logits matches f32", "[ops][bf16]") {
  const int64_t n = 40, v = 512;
  const Tensor logits16 = bf16_rnd({n, v}, 2, 2.0);
  const Tensor targets = cross_entropy_targets(n, v);
  Tensor lo = logits16.detach(), hi = logits16.to(DType::f32).detach();
  lo.set_requires_grad(true);
  hi.set_requires_grad(true);
  Tensor loss_lo = cross_entropy(lo, targets, -1), loss_hi = cross_entropy(hi, targets, -1);
  CHECK(loss_lo.dtype() == DType::f32);
  CHECK(std::abs(loss_lo.item<float>() - loss_hi.item<float>()) <= 1e-6 * std::abs(loss_hi.item<float>()));  // same values, f32 math
  loss_lo.backward();
  loss_hi.backward();
  REQUIRE(lo.grad().defined());
  CHECK(lo.grad().dtype() == DType::bf16);
  const double e = moetrain::testing::rel_error(lo.grad().to(DType::f64), hi.grad().to(DType::f64));
  INFO("gradient relative error " << e);
  CHECK(e <= kProductsBackwardTol);
  CHECK(e <= kProductsForwardTol);  // one rounding of an f32 result: 2^-9
}

TEST_CASE("bf16 cpu products: binary ops have the bits of the widened kernel", "[ops][bf16]") {
  struct Shapes {
    Shape a, b, out;
  };
  for (const Shapes& s : {Shapes{{5, 300}, {5, 300}, {5, 300}}, Shapes{{6, 7, 33}, {33}, {6, 7, 33}},
                          Shapes{{4, 1, 9}, {4, 5, 1}, {4, 5, 9}}}) {
    const Tensor a = bf16_rnd(s.a, 3), b = bf16_rnd(s.b, 4, 0.5);
    for (BinaryOp op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div, BinaryOp::max}) {
      INFO(fmt::format("op {} a {} b {}", static_cast<int>(op), s.a, s.b));
      Tensor native = empty(s.out, DType::bf16), wide = empty(s.out, DType::f32);
      cpu::binary_forward(op, native, a, b);
      cpu::binary_forward(op, wide, bf16_widened(a), bf16_widened(b));
      CHECK(moetrain::testing::bitwise_equal(native, bf16_rounded(wide)));
    }
  }
  // NaN stays NaN through the rounding (max passes a NaN on).
  Tensor a = from_vector({NAN, 1.0, -2.0}, {3}, DType::bf16);
  Tensor b = from_vector({0.0, NAN, 3.0}, {3}, DType::bf16);
  Tensor out = empty({3}, DType::bf16);
  cpu::binary_forward(BinaryOp::max, out, a, b);
  const std::vector<double> got = out.to_vector();
  CHECK(std::isnan(got[0]));
  CHECK(got[2] == 3.0);
}

TEST_CASE("bf16 cpu products: SiTU-GLU in blocks has the bits of the widened kernel", "[ops][bf16]") {
  // 5000 elements: several 1024-element blocks per thread and a partial one.
  const Tensor gate = bf16_rnd({5, 1000}, 5, 2.0), up = bf16_rnd({5, 1000}, 6, 3.0);
  const Tensor dout = bf16_rnd({5, 1000}, 7);
  for (double lambda : {0.0, 2.5}) {
    INFO("lambda " << lambda);
    Tensor native = empty_like(gate), wide = empty(gate.shape(), DType::f32);
    cpu::situ_glu_forward(native, gate, up, 1.5, lambda);
    cpu::situ_glu_forward(wide, bf16_widened(gate), bf16_widened(up), 1.5, lambda);
    CHECK(moetrain::testing::bitwise_equal(native, bf16_rounded(wide)));
    Tensor dg = empty_like(gate), du = empty_like(gate);
    Tensor wdg = empty(gate.shape(), DType::f32), wdu = empty(gate.shape(), DType::f32);
    double beta_native = 0, beta_wide = 0;
    cpu::situ_glu_backward(dg, du, &beta_native, dout, gate, up, 1.5, lambda);
    cpu::situ_glu_backward(wdg, wdu, &beta_wide, bf16_widened(dout), bf16_widened(gate), bf16_widened(up), 1.5, lambda);
    CHECK(moetrain::testing::bitwise_equal(dg, bf16_rounded(wdg)));
    CHECK(moetrain::testing::bitwise_equal(du, bf16_rounded(wdu)));
    CHECK(std::abs(beta_native - beta_wide) <= 1e-12 * std::abs(beta_wide));
    CHECK(beta_wide != 0.0);
  }
}

TEST_CASE("bf16 cpu products: SiTU-GLU and binary ops on bf16 match f32", "[ops][bf16]") {
  const Tensor gate = bf16_rnd({3, 8, 96}, 8, 2.0), up = bf16_rnd({3, 8, 96}, 9, 2.0);
  Tensor lo_g = gate.detach(), lo_u = up.detach();
  Tensor hi_g = gate.to(DType::f32).detach(), hi_u = up.to(DType::f32).detach();
  for (Tensor* t : {&lo_g, &lo_u, &hi_g, &hi_u}) t->set_requires_grad(true);
  Tensor lo = mul(situ_glu(lo_g, lo_u, 1.0, 3.0), add(lo_u, lo_g));
  Tensor hi = mul(situ_glu(hi_g, hi_u, 1.0, 3.0), add(hi_u, hi_g));
  REQUIRE(lo.dtype() == DType::bf16);
  const double ef = moetrain::testing::rel_error(lo.to(DType::f64), hi.to(DType::f64));
  INFO("forward relative error " << ef);
  CHECK(ef <= kProductsForwardTol);
  const Tensor w = bf16_rnd(lo.shape(), 10);
  autograd::backward({lo}, {w});
  autograd::backward({hi}, {w.to(DType::f32)});
  for (auto [l, h] : {std::pair{lo_g, hi_g}, std::pair{lo_u, hi_u}}) {
    REQUIRE(l.grad().defined());
    CHECK(l.grad().dtype() == DType::bf16);
    const double eb = moetrain::testing::rel_error(l.grad().to(DType::f64), h.grad().to(DType::f64));
    INFO("gradient relative error " << eb);
    CHECK(eb <= kProductsBackwardTol);
  }
}

TEST_CASE("bf16 cpu products: the same bits at 1 and 2 threads", "[ops][bf16]") {
  moetrain::testing::ThreadCountGuard guard;
  const int64_t n = 33, v = 700;
  const Tensor logits = bf16_rnd({n, v}, 11, 3.0);
  const Tensor targets = cross_entropy_targets(n, v);
  const Tensor gate = bf16_rnd({7, 1100}, 12), up = bf16_rnd({7, 1100}, 13), dout = bf16_rnd({7, 1100}, 14);
  struct Run {
    CrossEntropyRun ce;
    Tensor sum, situ, dg, du;
    double dbeta = 0;
  };
  auto run = [&] {
    Run r;
    r.ce = cross_entropy_kernels(logits, targets, v);
    r.sum = empty(gate.shape(), DType::bf16);
    cpu::binary_forward(BinaryOp::add, r.sum, gate, up);
    r.situ = empty_like(gate);
    cpu::situ_glu_forward(r.situ, gate, up, 1.0, 2.0);
    r.dg = empty_like(gate);
    r.du = empty_like(gate);
    cpu::situ_glu_backward(r.dg, r.du, &r.dbeta, dout, gate, up, 1.0, 2.0);
    return r;
  };
  cpu::set_num_threads(1);
  const Run one = run();
  cpu::set_num_threads(2);
  const Run two = run();
  CHECK(moetrain::testing::bitwise_equal(one.ce.lse, two.ce.lse));
  CHECK(moetrain::testing::bitwise_equal(one.ce.grad, two.ce.grad));
  CHECK(one.ce.loss_sum == two.ce.loss_sum);
  CHECK(moetrain::testing::bitwise_equal(one.sum, two.sum));
  CHECK(moetrain::testing::bitwise_equal(one.situ, two.situ));
  CHECK(moetrain::testing::bitwise_equal(one.dg, two.dg));
  CHECK(moetrain::testing::bitwise_equal(one.du, two.du));
}

namespace {

struct AttentionRun {
  Tensor o, max_logit, dq, dk, dv;
};

// causal_attention forward (with QK-Clip's max logit) and backward with upstream w.
AttentionRun attention_run(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& w, double scale) {
  Tensor q = q0.detach(), k = k0.detach(), v = v0.detach();
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  AttentionRun r;
  r.o = causal_attention(q, k, v, scale, &r.max_logit);
  autograd::backward({r.o}, {w.to(r.o.dtype())});
  r.dq = q.grad();
  r.dk = k.grad();
  r.dv = v.grad();
  return r;
}

}  // namespace

TEST_CASE("bf16 cpu products: causal attention on oneDNN's bf16 products matches f32", "[ops][bf16][attention]") {
  struct Case {
    int64_t B, T, Tk, H, Dk, Dv;
  };
  // Several query tiles with a partial last one; a decode-like query block (T < Tk);
  // MLA's head dims (Dk 96, Dv 64).
  for (Case c : {Case{2, 150, 150, 3, 40, 24}, Case{1, 20, 90, 2, 32, 32}, Case{1, 256, 256, 2, 96, 64}}) {
    INFO(fmt::format("B {} T {} Tk {} H {} Dk {} Dv {}", c.B, c.T, c.Tk, c.H, c.Dk, c.Dv));
    const Tensor q = bf16_rnd({c.B, c.T, c.H, c.Dk}, 20, 1.5), k = bf16_rnd({c.B, c.Tk, c.H, c.Dk}, 21, 1.5);
    const Tensor v = bf16_rnd({c.B, c.Tk, c.H, c.Dv}, 22), w = bf16_rnd({c.B, c.T, c.H, c.Dv}, 23);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.Dk));
    const AttentionRun lo = attention_run(q, k, v, w, scale);
    const AttentionRun hi = attention_run(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32), w, scale);
    CHECK(lo.o.dtype() == DType::bf16);
    CHECK(lo.max_logit.dtype() == DType::f32);
    const double eo = moetrain::testing::rel_error(lo.o.to(DType::f64), hi.o.to(DType::f64));
    // the row maxima come from f32 scores of the same bf16 values: f32 rounding only
    const double em = moetrain::testing::rel_error(lo.max_logit.to(DType::f64), hi.max_logit.to(DType::f64));
    INFO("forward relative error " << eo << ", max logit " << em);
    CHECK(eo <= kProductsForwardTol);
    CHECK(em <= 1e-5);
    for (auto [l, h, what] : {std::tuple{lo.dq, hi.dq, "dq"}, std::tuple{lo.dk, hi.dk, "dk"},
                              std::tuple{lo.dv, hi.dv, "dv"}}) {
      REQUIRE(l.defined());
      CHECK(l.dtype() == DType::bf16);
      const double e = moetrain::testing::rel_error(l.to(DType::f64), h.to(DType::f64));
      INFO(what << " relative error " << e);
      CHECK(e <= kProductsBackwardTol);
    }
  }
}

TEST_CASE("bf16 cpu products: causal attention's bf16 path gives the same bits at 1 and 2 threads",
          "[ops][bf16][attention]") {
  moetrain::testing::ThreadCountGuard guard;
  const Tensor q = bf16_rnd({2, 130, 2, 48}, 30), k = bf16_rnd({2, 130, 2, 48}, 31);
  const Tensor v = bf16_rnd({2, 130, 2, 32}, 32), w = bf16_rnd({2, 130, 2, 32}, 33);
  cpu::set_num_threads(1);
  const AttentionRun one = attention_run(q, k, v, w, 0.2);
  cpu::set_num_threads(2);
  const AttentionRun two = attention_run(q, k, v, w, 0.2);
  CHECK(moetrain::testing::bitwise_equal(one.o, two.o));
  CHECK(moetrain::testing::bitwise_equal(one.max_logit, two.max_logit));
  CHECK(moetrain::testing::bitwise_equal(one.dq, two.dq));
  CHECK(moetrain::testing::bitwise_equal(one.dk, two.dk));
  CHECK(moetrain::testing::bitwise_equal(one.dv, two.dv));
}

TEST_CASE("bf16 cpu products: causal attention's products run where a dense product runs (brgemm: AMX)",
          "[ops][bf16][attention]") {
  // oneDNN 2.6 runs a bf16 product on AMX only in its brgemm matmul, which refuses row
  // strides other than the width: attention packs its strided per-head operands into
  // dense buffers, so every one of its products gets the implementation a dense
  // product of the GEMM's shape gets (brg: here and on AMX CPUs; gemm:jit emulation on
  // AVX-512 without bf16 instructions), never gemm:jit for want of packing.
  if (!cpu::onednn::has_bf16_kernels()) {
    WARN("oneDNN has no bf16 matmul on this CPU (" << cpu::onednn::effective_isa() << "): nothing to check");
    return;
  }
  const std::string dense = cpu::onednn::matmul_impl(64, 128, 64);
  const std::string family = dense.substr(0, dense.find(':'));
  for (auto [T, H, Dk, Dv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{150, 3, 32, 48}, {64, 2, 96, 64}}) {
    INFO(fmt::format("T {} H {} Dk {} Dv {}; a dense product: {}", T, H, Dk, Dv, dense));
    const Tensor q = bf16_rnd({2, T, H, Dk}, 24), k = bf16_rnd({2, T, H, Dk}, 25);
    const Tensor v = bf16_rnd({2, T, H, Dv}, 26), w = bf16_rnd({2, T, H, Dv}, 27);
    cpu::onednn::reset_impl_counts();
    attention_run(q, k, v, w, 0.125);
    int64_t calls = 0;
    for (const auto& [impl, n] : cpu::onednn::impl_counts()) {
      INFO(impl << ": " << n << " calls");
      CHECK(impl.substr(0, impl.find(':')) == family);
      calls += n;
    }
    // forward: S and O per query tile; backward: P, dP, dQ, dK, dV per query tile, per
    // (batch, head): 2 x H x tiles x 7 products.
    CHECK(calls == 2 * H * ((T + 63) / 64) * 7);
  }
}

TEST_CASE("bf16 cpu products: AttnRes token by token has the bits of the widened kernel", "[ops][bf16]") {
  // M = 3 sources of [2, 37, 48]; proj bf16, norm f32 (a parameter that stays f32);
  // source 1 needs no gradient.
  const int64_t M = 3, D = 48;
  std::vector<Tensor> src;
  for (int64_t m = 0; m < M; ++m) src.push_back(bf16_rnd({2, 37, D}, 40 + static_cast<uint64_t>(m)));
  const Tensor proj = bf16_rnd({D}, 50, 0.5), norm = randn({D}, DType::f32, 51);
  std::vector<const Tensor*> ptrs, wide_ptrs;
  std::vector<Tensor> wide_src;
  for (const Tensor& t : src) wide_src.push_back(bf16_widened(t));
  for (int64_t m = 0; m < M; ++m) {
    ptrs.push_back(&src[static_cast<size_t>(m)]);
    wide_ptrs.push_back(&wide_src[static_cast<size_t>(m)]);
  }
  const Tensor wide_proj = bf16_widened(proj);
  Tensor h = empty(src[0].shape(), DType::bf16), wh = empty(src[0].shape(), DType::f32);
  Tensor alpha = empty({2, 37, M}, DType::f32), rstd = empty({2, 37, M}, DType::f32);
  Tensor walpha = empty({2, 37, M}, DType::f32), wrstd = empty({2, 37, M}, DType::f32);
  cpu::attn_res_forward(h, alpha, rstd, ptrs, proj, norm, 1e-5);
  cpu::attn_res_forward(wh, walpha, wrstd, wide_ptrs, wide_proj, norm, 1e-5);
  CHECK(moetrain::testing::bitwise_equal(h, bf16_rounded(wh)));
  CHECK(moetrain::testing::bitwise_equal(alpha, walpha));
  CHECK(moetrain::testing::bitwise_equal(rstd, wrstd));
  const Tensor gh = bf16_rnd(src[0].shape(), 52);
  std::vector<Tensor> gs = {empty_like(src[0]), Tensor(), empty_like(src[0])};
  std::vector<Tensor> wgs = {empty(src[0].shape(), DType::f32), Tensor(), empty(src[0].shape(), DType::f32)};
  Tensor gp = empty_like(proj), gn = empty_like(norm), wgp = empty({D}, DType::f32), wgn = empty({D}, DType::f32);
  cpu::attn_res_backward(gs, &gp, &gn, gh, ptrs, proj, norm, alpha, rstd);
  cpu::attn_res_backward(wgs, &wgp, &wgn, bf16_widened(gh), wide_ptrs, wide_proj, norm, walpha, wrstd);
  CHECK(moetrain::testing::bitwise_equal(gs[0], bf16_rounded(wgs[0])));
  CHECK(!gs[1].defined());
  CHECK(moetrain::testing::bitwise_equal(gs[2], bf16_rounded(wgs[2])));
  CHECK(gp.dtype() == DType::bf16);
  CHECK(moetrain::testing::bitwise_equal(gp, bf16_rounded(wgp)));
  CHECK(moetrain::testing::bitwise_equal(gn, wgn));  // norm stays f32: its gradient too
}
