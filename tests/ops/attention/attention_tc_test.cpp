// The tensor-core attention bodies (ops/attention/attention_tc.h), run on the host block by
// block (HostBlock, HostMma standing in for the tensor cores: bf16 operands, f32
// sums) against the CPU attention kernels on the same bf16-rounded inputs. This
// runs on every machine: what a GPU run of attention_tc_cuda.cu adds is the
// launch, wmma's fragment handling and the hardware's summation order, checked by
// the bf16 [cuda] cases in attention_test.cpp.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "moetrain.h"
#include "ops/attention/attention_kernels.h"
#include "ops/attention/attention_tc.h"
#include "ops/simt_orders.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::rel_error;
using moetrain::testing::run_in_all_orders;
using simt::HostOrder;

namespace {

struct Case {
  int64_t B, T, Tk, H, Dk, Dv;
};

struct Outputs {
  Tensor o, lse, grad_q, grad_k, grad_v;  // f32 (o and the gradients widened from bf16)
};

// The three bodies on the host, as attention_tc_cuda.cu launches them: a block per
// (tile, b·h); delta = rowsum(dO ⊙ O) from the bf16 O, as attention_cuda.cu does.
Outputs run_bodies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_o, double scale,
                   HostOrder order) {
  const int64_t B = q.size(0), T = q.size(1), Tk = k.size(1), H = q.size(2);
  const int Dk = static_cast<int>(q.size(3)), Dv = static_cast<int>(v.size(3));
  Tensor o = empty({B, T, H, Dv}, DType::bf16), lse = empty({B, H, T}, DType::f32);
  Tensor gq = empty(q.shape(), DType::bf16), gk = empty(k.shape(), DType::bf16), gv = empty(v.shape(), DType::bf16);
  simt::TcAttention<bf16> a;
  a.B = B;
  a.Tq = T;
  a.Tk = Tk;
  a.off = Tk - T;
  a.H = H;
  a.Dk = Dk;
  a.Dv = Dv;
  a.scale = static_cast<float>(scale);
  a.q = q.data<bf16>();
  a.k = k.data<bf16>();
  a.v = v.data<bf16>();
  a.grad_o = grad_o.data<bf16>();
  a.o = o.data<bf16>();
  a.lse = lse.data<float>();
  a.grad_q = gq.data<bf16>();
  a.grad_k = gk.data<bf16>();
  a.grad_v = gv.data<bf16>();
  const simt::HostBlock blk = testing::host_block(simt::kTcThreads, order);
  const int64_t tiles_q = (T + simt::kTcTile - 1) / simt::kTcTile, tiles_k = (Tk + simt::kTcTile - 1) / simt::kTcTile;
  std::vector<unsigned char> fwd(simt::TcForwardSmem<float>(nullptr, Dk, Dv).bytes),
      kv(simt::TcBackwardSmem<float>(nullptr, Dk, Dv, true).bytes),
      dq(simt::TcBackwardSmem<float>(nullptr, Dk, Dv, false).bytes);
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < tiles_q; ++t) simt::tc_attention_forward<simt::HostMma>(blk, a, t, bh, fwd.data());
  // delta[b, h, t] = Σ_d dO O, in f32 from the stored bf16 values.
  Tensor delta = zeros({B, H, T}, DType::f32);
  const Tensor of = o.to(DType::f32), gof = grad_o.to(DType::f32);
  const float *po = of.data<float>(), *pg = gof.data<float>();
  float* pd = delta.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float s = 0;
        for (int64_t d = 0; d < Dv; ++d) s += pg[((b * T + t) * H + h) * Dv + d] * po[((b * T + t) * H + h) * Dv + d];
        pd[(b * H + h) * T + t] = s;
      }
  a.delta = delta.data<float>();
  for (int64_t bh = 0; bh < B * H; ++bh) {
    for (int64_t t = 0; t < tiles_k; ++t) simt::tc_attention_grad_kv<simt::HostMma>(blk, a, t, bh, kv.data());
    for (int64_t t = 0; t < tiles_q; ++t) simt::tc_attention_grad_q<simt::HostMma>(blk, a, t, bh, dq.data());
  }
  return {of, lse, gq.to(DType::f32), gk.to(DType::f32), gv.to(DType::f32)};
}

bool same_bits(const Outputs& a, const Outputs& b) {
  return testing::same_bits({&a.o, &a.lse, &a.grad_q, &a.grad_k, &a.grad_v},
                            {&b.o, &b.lse, &b.grad_q, &b.grad_k, &b.grad_v});
}

// The CPU kernels on f32 copies of the same bf16 values.
Outputs run_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_o, double scale) {
  Tensor qf = q.to(DType::f32), kf = k.to(DType::f32), vf = v.to(DType::f32), gf = grad_o.to(DType::f32);
  Tensor o = empty({q.size(0), q.size(1), q.size(2), v.size(3)}, DType::f32);
  Tensor lse = empty({q.size(0), q.size(2), q.size(1)}, DType::f32);
  cpu::causal_attention_forward(o, lse, qf, kf, vf, scale);
  Tensor gq = zeros_like(qf), gk = zeros_like(kf), gv = zeros_like(vf);  // as the op passes them
  cpu::causal_attention_backward(gq, gk, gv, gf, qf, kf, vf, o, lse, scale);
  return {o, lse, gq, gk, gv};
}

}  // namespace

TEST_CASE("attention (tensor-core bodies on the host): match the CPU kernels", "[ops][attention][simt]") {
  const std::vector<Case> cases = {
      {1, 1, 1, 1, 16, 16},      // one row, one key
      {2, 37, 37, 3, 64, 64},    // GPT-2's head dim, a partial tile
      {1, 130, 130, 2, 32, 48},  // three tiles, Dk != Dv
      {1, 20, 85, 2, 16, 32},    // 65 cached keys: key tiles beyond the query tile
      {1, 64, 64, 1, 192, 128},  // MLA-like Dk > Dv, one full tile
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(fmt::format("B={} T={} Tk={} H={} Dk={} Dv={}", c.B, c.T, c.Tk, c.H, c.Dk, c.Dv)) {
      Tensor q = randn({c.B, c.T, c.H, c.Dk}, DType::f64, 1).to(DType::bf16);
      Tensor k = randn({c.B, c.Tk, c.H, c.Dk}, DType::f64, 2).to(DType::bf16);
      Tensor v = randn({c.B, c.Tk, c.H, c.Dv}, DType::f64, 3).to(DType::bf16);
      Tensor grad_o = randn({c.B, c.T, c.H, c.Dv}, DType::f64, 4).to(DType::bf16);
      const double scale = 1.5 / std::sqrt(static_cast<double>(c.Dk));  // peaked rows as well as flat ones
      Outputs tc = run_in_all_orders([&](HostOrder o) { return run_bodies(q, k, v, grad_o, scale, o); });
      Outputs ref = run_cpu(q, k, v, grad_o, scale);
      // Scores are exact products of bf16 values summed in f32: lse agrees to f32
      // rounding. P (forward) and dS (backward) are rounded to bf16 before their
      // products, and O and the gradients are stored in bf16.
      CHECK(rel_error(tc.lse, ref.lse) < 1e-5);
      CHECK(rel_error(tc.o, ref.o) < 1e-2);
      CHECK(rel_error(tc.grad_v, ref.grad_v) < 2e-2);
      CHECK(rel_error(tc.grad_k, ref.grad_k) < 3e-2);
      CHECK(rel_error(tc.grad_q, ref.grad_q) < 3e-2);
    }
  }
}

TEST_CASE("attention (tensor-core bodies): shared memory fits the GPU for the heads used", "[ops][attention][simt]") {
  // H100/H200 offer 227 KiB per block (opt-in): GPT-2 (64), K3's MLA (192/128) and
  // 128/128 heads must run on the tensor cores; the largest kernel is dK/dV.
  const size_t limit = 227 * 1024;
  using E = uint16_t;  // the GPU's operands are 2 bytes (bf16)
  for (auto [Dk, Dv] : {std::pair{64, 64}, std::pair{128, 128}, std::pair{192, 128}}) {
    CHECK(simt::TcForwardSmem<E>(nullptr, Dk, Dv).bytes <= limit);
    CHECK(simt::TcBackwardSmem<E>(nullptr, Dk, Dv, true).bytes <= limit);
    CHECK(simt::TcBackwardSmem<E>(nullptr, Dk, Dv, false).bytes <= limit);
  }
}
