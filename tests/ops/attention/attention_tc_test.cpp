// The tensor-core attention bodies (ops/attention/attention_tc.h), run on the host block by
// block (HostBlock, HostMma standing in for the tensor cores: the bodies' lane maps
// fed to a model of ldmatrix and mma.m16n8k16, bf16 operands, f32 sums) against the
// CPU attention kernels on the same bf16-rounded inputs. This runs on every
// machine: what a GPU run of attention_tc_cuda.cu adds is the launch, the hardware
// itself (the model is PTX's documentation) and its summation order, checked by
// the bf16 [cuda] cases in attention_test.cpp and the one here that sets the
// register path against the shared one. Both accumulator paths
// (simt::TcAccumulators) run here; the register path must give the shared
// path's bits. The [banks] cases count the bodies' shared-memory bank conflicts
// (ops/smem_banks.h's model) from the bodies' own layouts.
#include <catch2/catch.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "moetrain.h"
#include "ops/attention/attention_kernels.h"
#include "ops/attention/attention_tc.h"
#include "ops/simt_orders.h"
#include "ops/smem_banks.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::rel_error;
using moetrain::testing::run_in_all_orders;
using simt::HostOrder;
using simt::TcAccumulators;

namespace {

struct Case {
  int64_t B, T, Tk, H, Dk, Dv;
};

struct Outputs {
  Tensor o, lse, grad_q, grad_k, grad_v;  // f32 (o and the gradients widened from bf16)
  Tensor row_max;                         // [B, H, T] f32: the forward's row max (QK-Clip)
};

// The three bodies on the host, as attention_tc_cuda.cu launches them: a block per
// (tile, b·h); delta = rowsum(dO ⊙ O) from the bf16 O, as attention_cuda.cu does.
// DK = DV = 0: the shared path; else the register path for those head dims (all
// three bodies, the dK/dV one included where the GPU keeps the shared path).
template <int DK, int DV>
Outputs run_bodies_with(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_o, double scale,
                        HostOrder order) {
  const int64_t B = q.size(0), T = q.size(1), Tk = k.size(1), H = q.size(2);
  const int Dk = static_cast<int>(q.size(3)), Dv = static_cast<int>(v.size(3));
  Tensor o = empty({B, T, H, Dv}, DType::bf16), lse = empty({B, H, T}, DType::f32);
  Tensor row_max = full({B, H, T}, std::nan(""), DType::f32);  // every element must be written
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
  a.row_max = row_max.data<float>();
  a.grad_q = gq.data<bf16>();
  a.grad_k = gk.data<bf16>();
  a.grad_v = gv.data<bf16>();
  const simt::HostBlock blk = testing::host_block(simt::kTcThreads, order);
  const int64_t tiles_q = (T + simt::kTcTile - 1) / simt::kTcTile, tiles_k = (Tk + simt::kTcTile - 1) / simt::kTcTile;
  const TcAccumulators acc = DV > 0 ? TcAccumulators::registers : TcAccumulators::shared;
  std::vector<unsigned char> fwd(simt::TcForwardSmem<float>(nullptr, Dk, Dv, acc).bytes),
      kv(simt::TcBackwardSmem<float>(nullptr, Dk, Dv, true, acc).bytes),
      dq(simt::TcBackwardSmem<float>(nullptr, Dk, Dv, false, acc).bytes);
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < tiles_q; ++t)
      simt::tc_attention_forward<simt::HostMma, DK, DV>(blk, a, t, bh, fwd.data());
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
    for (int64_t t = 0; t < tiles_k; ++t)
      simt::tc_attention_grad_kv<simt::HostMma, DK, DV>(blk, a, t, bh, kv.data());
    for (int64_t t = 0; t < tiles_q; ++t)
      simt::tc_attention_grad_q<simt::HostMma, DK, DV>(blk, a, t, bh, dq.data());
  }
  return {of, lse, gq.to(DType::f32), gk.to(DType::f32), gv.to(DType::f32), row_max};
}

bool tc_has_register_path(int64_t Dk, int64_t Dv) {
  return simt::tc_register_dims(static_cast<int>(Dk), static_cast<int>(Dv), [](auto) {});
}

Outputs run_bodies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_o, double scale,
                   HostOrder order, TcAccumulators acc = TcAccumulators::shared) {
  if (acc == TcAccumulators::shared) return run_bodies_with<0, 0>(q, k, v, grad_o, scale, order);
  Outputs out;
  const bool found = simt::tc_register_dims(static_cast<int>(q.size(3)), static_cast<int>(v.size(3)), [&](auto d) {
    out = run_bodies_with<decltype(d)::Dk, decltype(d)::Dv>(q, k, v, grad_o, scale, order);
  });
  REQUIRE(found);
  return out;
}

const char* tc_acc_name(TcAccumulators acc) { return acc == TcAccumulators::shared ? "shared" : "registers"; }

bool same_bits(const Outputs& a, const Outputs& b) {
  return testing::same_bits({&a.o, &a.lse, &a.grad_q, &a.grad_k, &a.grad_v, &a.row_max},
                            {&b.o, &b.lse, &b.grad_q, &b.grad_k, &b.grad_v, &b.row_max});
}

// The CPU kernels on f32 copies of the same bf16 values.
Outputs run_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_o, double scale) {
  Tensor qf = q.to(DType::f32), kf = k.to(DType::f32), vf = v.to(DType::f32), gf = grad_o.to(DType::f32);
  Tensor o = empty({q.size(0), q.size(1), q.size(2), v.size(3)}, DType::f32);
  Tensor lse = empty({q.size(0), q.size(2), q.size(1)}, DType::f32), row_max = empty_like(lse);
  cpu::causal_attention_forward(o, lse, qf, kf, vf, scale, &row_max);
  Tensor gq = zeros_like(qf), gk = zeros_like(kf), gv = zeros_like(vf);  // as the op passes them
  cpu::causal_attention_backward(gq, gk, gv, gf, qf, kf, vf, o, lse, scale);
  return {o, lse, gq, gk, gv, row_max};
}

}  // namespace

TEST_CASE("attention (tensor-core bodies on the host): match the CPU kernels", "[ops][attention][simt]") {
  const std::vector<Case> cases = {
      {1, 1, 1, 1, 16, 16},      // one row, one key
      {2, 37, 37, 3, 64, 64},    // GPT-2's head dim, a partial tile
      {1, 130, 130, 2, 32, 48},  // three tiles, Dk != Dv
      {1, 20, 85, 2, 16, 32},    // 65 cached keys: key tiles beyond the query tile
      {1, 64, 64, 1, 192, 128},  // MLA-like Dk > Dv, one full tile
      {1, 100, 100, 2, 96, 64},  // k3-small's MLA, two tiles
  };
  for (const Case& c : cases)
    for (TcAccumulators acc : {TcAccumulators::shared, TcAccumulators::registers}) {
      if (acc == TcAccumulators::registers && !tc_has_register_path(c.Dk, c.Dv)) continue;
      DYNAMIC_SECTION(fmt::format("{} B={} T={} Tk={} H={} Dk={} Dv={}", tc_acc_name(acc), c.B, c.T, c.Tk, c.H,
                                  c.Dk, c.Dv)) {
        Tensor q = randn({c.B, c.T, c.H, c.Dk}, DType::f64, 1).to(DType::bf16);
        Tensor k = randn({c.B, c.Tk, c.H, c.Dk}, DType::f64, 2).to(DType::bf16);
        Tensor v = randn({c.B, c.Tk, c.H, c.Dv}, DType::f64, 3).to(DType::bf16);
        Tensor grad_o = randn({c.B, c.T, c.H, c.Dv}, DType::f64, 4).to(DType::bf16);
        const double scale = 1.5 / std::sqrt(static_cast<double>(c.Dk));  // peaked rows as well as flat ones
        Outputs tc = run_in_all_orders([&](HostOrder o) { return run_bodies(q, k, v, grad_o, scale, o, acc); });
        Outputs ref = run_cpu(q, k, v, grad_o, scale);
        // Scores are exact products of bf16 values summed in f32: lse agrees to f32
        // rounding. P (forward) and dS (backward) are rounded to bf16 before their
        // products, and O and the gradients are stored in bf16.
        CHECK(rel_error(tc.lse, ref.lse) < 1e-5);
        CHECK(count_non_finite(tc.row_max) == 0);          // every row written (it starts NaN)
        CHECK(rel_error(tc.row_max, ref.row_max) < 1e-5);  // f32 scores summed in another order, then a max
        CHECK(rel_error(tc.o, ref.o) < 1e-2);
        CHECK(rel_error(tc.grad_v, ref.grad_v) < 2e-2);
        CHECK(rel_error(tc.grad_k, ref.grad_k) < 3e-2);
        CHECK(rel_error(tc.grad_q, ref.grad_q) < 3e-2);
      }
    }
}

TEST_CASE("attention (tensor-core bodies on the host): register accumulators give the shared path's bits",
          "[ops][attention][simt]") {
  // Every register pair (simt::tc_register_dims) on partial tiles, several
  // query tiles and cached keys (Tq != Tk): the same f32 operations in the same
  // order, so the same bits; the register bodies also in all three thread orders.
  const std::vector<std::pair<int64_t, int64_t>> pairs = {{32, 32}, {48, 32}, {64, 64}, {96, 64}, {128, 128},
                                                          {192, 128}};
  struct Shape {
    int64_t B, T, Tk, H;
  };
  const std::vector<Shape> shapes = {{2, 37, 37, 2}, {1, 130, 130, 1}, {1, 20, 85, 1}, {1, 70, 135, 2}};
  for (auto [Dk, Dv] : pairs) {
    REQUIRE(tc_has_register_path(Dk, Dv));
    for (const Shape& sh : shapes) {
      DYNAMIC_SECTION(fmt::format("B={} T={} Tk={} H={} Dk={} Dv={}", sh.B, sh.T, sh.Tk, sh.H, Dk, Dv)) {
        const uint64_t seed = static_cast<uint64_t>(Dk * 1000 + sh.Tk);
        Tensor q = randn({sh.B, sh.T, sh.H, Dk}, DType::f64, seed).to(DType::bf16);
        Tensor k = randn({sh.B, sh.Tk, sh.H, Dk}, DType::f64, seed + 1).to(DType::bf16);
        Tensor v = randn({sh.B, sh.Tk, sh.H, Dv}, DType::f64, seed + 2).to(DType::bf16);
        Tensor grad_o = randn({sh.B, sh.T, sh.H, Dv}, DType::f64, seed + 3).to(DType::bf16);
        const double scale = 1.5 / std::sqrt(static_cast<double>(Dk));
        const Outputs shared = run_bodies(q, k, v, grad_o, scale, HostOrder::natural, TcAccumulators::shared);
        const Outputs regs = run_in_all_orders(
            [&](HostOrder o) { return run_bodies(q, k, v, grad_o, scale, o, TcAccumulators::registers); });
        CHECK(testing::same_bits(regs.o, shared.o));
        CHECK(testing::same_bits(regs.lse, shared.lse));
        CHECK(testing::same_bits(regs.row_max, shared.row_max));
        CHECK(testing::same_bits(regs.grad_q, shared.grad_q));
        CHECK(testing::same_bits(regs.grad_k, shared.grad_k));
        CHECK(testing::same_bits(regs.grad_v, shared.grad_v));
      }
    }
  }
}

TEST_CASE("attention (tensor-core bodies): the lane maps give ldmatrix and mma the tile's elements",
          "[ops][attention][simt]") {
  // HostMma models ldmatrix.x4 and mma.m16n8k16 from PTX's fragment tables; fed
  // the bodies' lane maps (tc_ldsm_a, tc_ldsm_b, tc_ldsm_bt, tc_acc_cell) it
  // must give D = C + A B for every loader, and scale_rows row i times f[i].
  // Small integers: every product and sum is exact, in any order.
  constexpr int ld = 24, ldc = 20;  // padded strides, as the bodies use
  std::vector<float> A(16 * ld), B(16 * ld), Bt(16 * ld), C(16 * ldc, 0.0f), D(16 * ldc, 0.0f), f(16);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      A[i * ld + j] = static_cast<float>((i * 7 + j * 3) % 9 - 4);
      B[i * ld + j] = static_cast<float>((i * 5 + j * 11) % 7 - 3);
      Bt[j * ld + i] = B[i * ld + j];
      C[i * ldc + j] = static_cast<float>(i * 16 + j);
    }
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(i + 2);
  auto expect = [&](int i, int j) {
    float s = C[i * ldc + j];
    for (int k = 0; k < 16; ++k) s += A[i * ld + k] * B[k * ld + j];
    return s;
  };
  simt::HostMma::TileA a;
  simt::HostMma::TileB b;
  simt::HostMma::TileBt bt;
  simt::HostMma::load_a(a, A.data(), ld);
  simt::HostMma::load_b(b, B.data(), ld);
  simt::HostMma::load_bt(bt, Bt.data(), ld);
  for (const simt::HostMma::Tile* y : {&b, &bt}) {
    simt::HostMma::Acc acc;
    simt::HostMma::load_acc(acc, C.data(), ldc);
    simt::HostMma::mma(acc, a, *y);
    simt::HostMma::store_acc(D.data(), acc, ldc);
    int wrong = 0;
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) wrong += D[i * ldc + j] != expect(i, j);
    CHECK(wrong == 0);
  }
  simt::HostMma::Acc acc;
  simt::HostMma::load_acc(acc, C.data(), ldc);
  simt::HostMma::scale_rows(acc, f.data());
  simt::HostMma::store_acc(D.data(), acc, ldc);
  int wrong = 0;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) wrong += D[i * ldc + j] != C[i * ldc + j] * f[i];
  CHECK(wrong == 0);
}

TEST_CASE("attention (tensor-core bodies): staging copies 16-byte chunks where aligned, elements otherwise",
          "[ops][attention][simt]") {
  // Rows row0 + t·H of a [.., H, dim] tensor, t in [first, first + 64), rows >=
  // limit as zeros: from a 16-byte aligned pointer (the chunked path, cp.async on
  // the GPU) and from one 2 bytes further on (the element-by-element path).
  const int dim = 48, ld = dim + simt::kTcPad;
  const int64_t H = 3, row0 = 1, first = 5, limit = 50;
  const size_t count = static_cast<size_t>((row0 + (first + simt::kTcTile) * H) * dim);
  std::vector<bf16> storage(count + 16);
  bf16* aligned = storage.data();
  while (!simt::tc_aligned16(aligned)) ++aligned;
  bf16* odd = aligned + 1;
  REQUIRE_FALSE(simt::tc_aligned16(odd));
  for (bf16* src : {aligned, odd}) {
    for (size_t i = 0; i < count; ++i) src[i] = bf16::from_float(static_cast<float>(i % 251) - 125.0f);
    DYNAMIC_SECTION((src == aligned ? "aligned" : "2 bytes off")) {
      for (HostOrder order : {HostOrder::natural, HostOrder::reversed, HostOrder::shuffled}) {
        std::vector<float> dst(static_cast<size_t>(simt::kTcTile * ld), std::nan(""));
        simt::tc_stage<simt::HostMma>(testing::host_block(simt::kTcThreads, order), dst.data(), ld, src, row0, H,
                                      first, limit, dim);
        int wrong = 0;
        for (int r = 0; r < simt::kTcTile; ++r)
          for (int c = 0; c < dim; ++c) {
            const int64_t t = first + r;
            const float want = t < limit ? src[(row0 + t * H) * dim + c].to_float() : 0.0f;
            wrong += !(dst[static_cast<size_t>(r * ld + c)] == want);
          }
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("attention (tensor-core bodies): shared memory fits the GPU for the heads used", "[ops][attention][simt]") {
  // H100/H200 offer 227 KiB per block (opt-in): GPT-2 (64), K3's MLA (192/128) and
  // 128/128 heads must run on the tensor cores; the largest kernel is dK/dV.
  const size_t limit = 227 * 1024;
  using E = uint16_t;  // the GPU's operands are 2 bytes (bf16)
  for (auto [Dk, Dv] : {std::pair{64, 64}, std::pair{128, 128}, std::pair{192, 128}})
    for (TcAccumulators acc : {TcAccumulators::shared, TcAccumulators::registers}) {
      CHECK(simt::TcForwardSmem<E>(nullptr, Dk, Dv, acc).bytes <= limit);
      CHECK(simt::TcBackwardSmem<E>(nullptr, Dk, Dv, true, acc).bytes <= limit);
      CHECK(simt::TcBackwardSmem<E>(nullptr, Dk, Dv, false, acc).bytes <= limit);
    }
}

TEST_CASE("attention (tensor-core bodies): the register path's layouts drop the shared accumulators",
          "[ops][attention][simt]") {
  // Forward: O [64][Dv + 8] f32 goes (the row factors alpha [64] are in both);
  // dK/dV: dK [64][Dk + 8] and dV [64][Dv + 8] f32 go; dQ: dQ [64][Dk + 8] f32 goes.
  // Every array is a multiple of 128 bytes here, so no alignment padding moves.
  using E = uint16_t;
  for (auto [Dk, Dv] : {std::pair{32, 32}, std::pair{64, 64}, std::pair{96, 64}, std::pair{192, 128}}) {
    const size_t f32_rows = 64 * sizeof(float);
    const size_t o = f32_rows * static_cast<size_t>(Dv + 8), dk = f32_rows * static_cast<size_t>(Dk + 8);
    CHECK(simt::TcForwardSmem<E>(nullptr, Dk, Dv, TcAccumulators::shared).bytes -
              simt::TcForwardSmem<E>(nullptr, Dk, Dv, TcAccumulators::registers).bytes ==
          o);
    CHECK(simt::TcBackwardSmem<E>(nullptr, Dk, Dv, true, TcAccumulators::shared).bytes -
              simt::TcBackwardSmem<E>(nullptr, Dk, Dv, true, TcAccumulators::registers).bytes ==
          dk + o);
    CHECK(simt::TcBackwardSmem<E>(nullptr, Dk, Dv, false, TcAccumulators::shared).bytes -
              simt::TcBackwardSmem<E>(nullptr, Dk, Dv, false, TcAccumulators::registers).bytes ==
          dk);
  }
}

namespace {

using Lanes = std::array<int64_t, 32>;
constexpr int kIdle = -1;

// The byte offset of p from the start of the kernel's shared memory.
template <class X>
int64_t offset_of(const X* p, const unsigned char* base) {
  return reinterpret_cast<const unsigned char*>(p) - base;
}

// Worst passes of the staging copies into a [kTcTile][dim] bf16 array of row
// stride ld: warp w's lanes on chunk e = 32w + lane + k·threads, cell
// tc_chunk(e, dim), 16 bytes each (the GPU's cp.async, 8 lanes a phase).
int chunk_ways(int64_t at, int ld, int dim) {
  int worst = 1;
  const int chunks = simt::kTcTile * dim / simt::kTcChunk;
  for (int w = 0; w < simt::kTcWarps; ++w)
    for (int k = 0; k < chunks; k += simt::kTcThreads) {
      Lanes a;
      for (int l = 0; l < 32; ++l) {
        const int e = 32 * w + l + k;
        const simt::TcCell x = simt::tc_chunk(e, dim);
        a[static_cast<size_t>(l)] = e < chunks ? at + (int64_t{x.row} * ld + x.col) * 2 : kIdle;
      }
      worst = std::max(worst, testing::bank_ways(a, 16));
    }
  return worst;
}

// Worst passes of the elementwise phases over a [kTcTile][dim] array of row
// stride ld and `es`-byte elements (staging, zeroing, P and dS, the stores):
// warp w's lanes at element e = 32w + lane + k·threads, cell tc_cell(e, dim).
int elementwise_ways(int64_t at, int ld, int dim, int es) {
  int worst = 1;
  for (int w = 0; w < simt::kTcWarps; ++w)
    for (int k = 0; k < simt::kTcTile * dim; k += simt::kTcThreads) {
      Lanes a;
      for (int l = 0; l < 32; ++l) {
        const int e = 32 * w + l + k;
        const simt::TcCell x = simt::tc_cell(e, dim);
        a[static_cast<size_t>(l)] = e < simt::kTcTile * dim ? at + (int64_t{x.row} * ld + x.col) * es : kIdle;
      }
      worst = std::max(worst, testing::bank_ways(a, es));
    }
  return worst;
}

// The row statistics (lse, delta) as the backward's elementwise phases read them:
// by column (dK/dV: queries along the row) or by row (dQ).
int row_stat_ways(int64_t at, bool by_col) {
  int worst = 1;
  for (int w = 0; w < simt::kTcWarps; ++w)
    for (int k = 0; k < simt::kTcTile * simt::kTcTile; k += simt::kTcThreads) {
      Lanes a;
      for (int l = 0; l < 32; ++l) {
        const simt::TcCell x = simt::tc_cell(32 * w + l + k, simt::kTcTile);
        a[static_cast<size_t>(l)] = at + 4 * (by_col ? x.col : x.row);
      }
      worst = std::max(worst, testing::bank_ways(a, 4));
    }
  return worst;
}

// The forward's softmax phase: warp w's lanes on rows 16w + lane / 2, column
// tc_softmax_cell(lane, j).col of S (f32) and P (bf16) for j < kTcLaneCols; the
// first lane of each row on that row's statistics (mx, alpha, m, l).
struct SoftmaxWays {
  int S = 1, P = 1, stats = 1;
};
SoftmaxWays softmax_ways(const simt::TcForwardSmem<uint16_t>& s, const unsigned char* base) {
  SoftmaxWays r;
  for (int w = 0; w < simt::kTcWarps; ++w) {
    for (int j = 0; j < simt::kTcLaneCols; ++j) {
      Lanes aS, aP;
      for (int l = 0; l < 32; ++l) {
        const simt::TcCell x = simt::tc_softmax_cell(l, j);
        const int i = 16 * w + x.row;
        aS[static_cast<size_t>(l)] = offset_of(s.S + i * s.ld_t + x.col, base);
        aP[static_cast<size_t>(l)] = offset_of(s.P + i * s.ld_t + x.col, base);
      }
      r.S = std::max(r.S, testing::bank_ways(aS, 4));
      r.P = std::max(r.P, testing::bank_ways(aP, 2));
    }
    for (const float* stat : {s.mx, s.alpha, s.m, s.l}) {
      Lanes a;
      for (int l = 0; l < 32; ++l)
        a[static_cast<size_t>(l)] =
            l % simt::kTcRowLanes == 0 ? offset_of(stat + 16 * w + l / simt::kTcRowLanes, base) : kIdle;
      r.stats = std::max(r.stats, testing::bank_ways(a, 4));
    }
  }
  return r;
}

// Tile accesses of the products, for every 16x16 tile of an array, from the
// bodies' own lane maps: ldmatrix.x4 as an A operand (tc_ldsm_a), as a B
// operand given transposed (tc_ldsm_bt) and row-major (tc_ldsm_b), each lane a
// 16-byte row piece, 8 lanes a phase; an f32 accumulator tile loaded or stored
// by 8-byte accesses at tc_acc_cell(lane, e), e = 0, 2, 4, 6.
struct TileWays {
  int ldsm_a = 1, ldsm_bt = 1, ldsm_b = 1, acc = 1;
};
void operand_tile_ways(TileWays& r, const uint16_t* array, int ld, int dim, const unsigned char* base) {
  for (int row0 = 0; row0 < simt::kTcTile; row0 += 16)
    for (int col0 = 0; col0 < dim; col0 += 16) {
      const uint16_t* t = array + row0 * ld + col0;
      Lanes a, bt, b;
      for (int l = 0; l < 32; ++l) {
        const simt::TcRC ca = simt::tc_ldsm_a(l), cbt = simt::tc_ldsm_bt(l), cb = simt::tc_ldsm_b(l);
        a[static_cast<size_t>(l)] = offset_of(t + ca.row * ld + ca.col, base);
        bt[static_cast<size_t>(l)] = offset_of(t + cbt.row * ld + cbt.col, base);
        b[static_cast<size_t>(l)] = offset_of(t + cb.row * ld + cb.col, base);
      }
      r.ldsm_a = std::max(r.ldsm_a, testing::bank_ways(a, 16));
      r.ldsm_bt = std::max(r.ldsm_bt, testing::bank_ways(bt, 16));
      r.ldsm_b = std::max(r.ldsm_b, testing::bank_ways(b, 16));
    }
}
void acc_tile_ways(TileWays& r, const float* array, int ld, int dim, const unsigned char* base) {
  for (int row0 = 0; row0 < simt::kTcTile; row0 += 16)
    for (int col0 = 0; col0 < dim; col0 += 16)
      for (int e = 0; e < simt::kTcAccRegs; e += 2) {
        const float* t = array + row0 * ld + col0;
        Lanes a;
        for (int l = 0; l < 32; ++l) {
          const simt::TcRC c = simt::tc_acc_cell(l, e);
          a[static_cast<size_t>(l)] = offset_of(t + c.row * ld + c.col, base);
        }
        r.acc = std::max(r.acc, testing::bank_ways(a, 8));
      }
}

// The register path's stores: warp w's lanes read its 16 rows of S (the
// scratch the fragments were stored to), lane on columns lane and lane + 32.
int scratch_ways(const float* S, int ld_t, const unsigned char* base) {
  int worst = 1;
  for (int r = 0; r < simt::kTcTile; ++r)
    for (int c0 = 0; c0 < simt::kTcTile; c0 += 32) {
      Lanes a;
      for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = offset_of(S + r * ld_t + c0 + l, base);
      worst = std::max(worst, testing::bank_ways(a, 4));
    }
  return worst;
}

struct LayoutWays {
  SoftmaxWays softmax;
  int scratch = 1;        // the register path's stores through S
  int backward_rows = 1;  // S, dP, P, dS, lse, delta in the backward's elementwise phases
  int staging = 1;        // staging, zeroing and the stores
  TileWays tiles;
};

// Every shared access of the three bodies for heads Dk, Dv with row padding `pad`
// and accumulators `acc`, from the bodies' own layouts (TcForwardSmem,
// TcBackwardSmem with the GPU's 2-byte operands) and lane maps (tc_cell,
// tc_chunk, tc_softmax_cell, tc_ldsm_*, tc_acc_cell).
LayoutWays layout_ways(int Dk, int Dv, int pad, TcAccumulators acc) {
  using E = uint16_t;
  LayoutWays r;
  const bool shared = acc == TcAccumulators::shared;
  const simt::TcForwardSmem<E> f(nullptr, Dk, Dv, acc, pad);
  std::vector<unsigned char> fwd(f.bytes);
  const simt::TcForwardSmem<E> s(fwd.data(), Dk, Dv, acc, pad);
  const unsigned char* fb = fwd.data();
  r.softmax = softmax_ways(s, fb);
  r.staging = std::max({chunk_ways(offset_of(s.Q, fb), s.ld_k, Dk), chunk_ways(offset_of(s.K, fb), s.ld_k, Dk),
                        chunk_ways(offset_of(s.V, fb), s.ld_v, Dv)});
  operand_tile_ways(r.tiles, s.Q, s.ld_k, Dk, fb);
  operand_tile_ways(r.tiles, s.K, s.ld_k, Dk, fb);
  operand_tile_ways(r.tiles, s.V, s.ld_v, Dv, fb);
  operand_tile_ways(r.tiles, s.P, s.ld_t, simt::kTcTile, fb);
  acc_tile_ways(r.tiles, s.S, s.ld_t, simt::kTcTile, fb);
  if (shared) {
    r.staging = std::max(r.staging, elementwise_ways(offset_of(s.O, fb), s.ld_v, Dv, 4));
    acc_tile_ways(r.tiles, s.O, s.ld_v, Dv, fb);
  } else {
    r.scratch = scratch_ways(s.S, s.ld_t, fb);
  }
  for (bool key_tile : {true, false}) {
    const simt::TcBackwardSmem<E> g(nullptr, Dk, Dv, key_tile, acc, pad);
    std::vector<unsigned char> bwd(g.bytes);
    const simt::TcBackwardSmem<E> b(bwd.data(), Dk, Dv, key_tile, acc, pad);
    const unsigned char* bb = bwd.data();
    r.backward_rows = std::max({r.backward_rows, elementwise_ways(offset_of(b.S, bb), b.ld_t, simt::kTcTile, 4),
                                elementwise_ways(offset_of(b.dP, bb), b.ld_t, simt::kTcTile, 4),
                                elementwise_ways(offset_of(b.dS, bb), b.ld_t, simt::kTcTile, 2),
                                row_stat_ways(offset_of(b.lse, bb), key_tile),
                                row_stat_ways(offset_of(b.delta, bb), key_tile)});
    if (key_tile)
      r.backward_rows = std::max(r.backward_rows, elementwise_ways(offset_of(b.P, bb), b.ld_t, simt::kTcTile, 2));
    r.staging = std::max({r.staging, chunk_ways(offset_of(b.Q, bb), b.ld_k, Dk),
                          chunk_ways(offset_of(b.K, bb), b.ld_k, Dk), chunk_ways(offset_of(b.V, bb), b.ld_v, Dv),
                          chunk_ways(offset_of(b.dO, bb), b.ld_v, Dv)});
    for (const E* op : {b.Q, b.K}) operand_tile_ways(r.tiles, op, b.ld_k, Dk, bb);
    for (const E* op : {b.V, b.dO}) operand_tile_ways(r.tiles, op, b.ld_v, Dv, bb);
    operand_tile_ways(r.tiles, b.dS, b.ld_t, simt::kTcTile, bb);
    acc_tile_ways(r.tiles, b.S, b.ld_t, simt::kTcTile, bb);
    acc_tile_ways(r.tiles, b.dP, b.ld_t, simt::kTcTile, bb);
    if (shared) {
      acc_tile_ways(r.tiles, b.dXk, b.ld_k, Dk, bb);
      r.staging = std::max(r.staging, elementwise_ways(offset_of(b.dXk, bb), b.ld_k, Dk, 4));
    } else {
      r.scratch = std::max(r.scratch, scratch_ways(b.S, b.ld_t, bb));
    }
    if (key_tile) operand_tile_ways(r.tiles, b.P, b.ld_t, simt::kTcTile, bb);
    if (key_tile && shared) {
      acc_tile_ways(r.tiles, b.dXv, b.ld_v, Dv, bb);
      r.staging = std::max(r.staging, elementwise_ways(offset_of(b.dXv, bb), b.ld_v, Dv, 4));
    }
  }
  return r;
}

}  // namespace

TEST_CASE("attention (tensor-core bodies): shared-memory accesses are free of bank conflicts (at most 2-way)",
          "[ops][attention][simt][banks]") {
  for (auto [Dk, Dv] : {std::pair{16, 16}, std::pair{32, 48}, std::pair{64, 64}, std::pair{128, 128},
                        std::pair{192, 128}, std::pair{256, 256}})
    for (TcAccumulators acc : {TcAccumulators::shared, TcAccumulators::registers}) {
      DYNAMIC_SECTION(tc_acc_name(acc) << " Dk=" << Dk << " Dv=" << Dv) {
        const LayoutWays w = layout_ways(Dk, Dv, simt::kTcPad, acc);
        // The row phases: a warp's lanes on consecutive elements of one row.
        CHECK(w.softmax.S == 1);
        CHECK(w.softmax.P == 1);
        CHECK(w.softmax.stats == 1);
        CHECK(w.scratch == 1);
        CHECK(w.backward_rows == 1);
        // Staging and stores: a warp straddles two rows where 32 does not divide the head dim.
        CHECK(w.staging <= 2);
        // Tiles: the padded rows put the 8 row pieces of an ldmatrix phase on distinct banks.
        CHECK(w.tiles.ldsm_a == 1);
        CHECK(w.tiles.ldsm_bt == 1);
        CHECK(w.tiles.ldsm_b == 1);
        CHECK(w.tiles.acc == 1);
      }
    }
}

TEST_CASE("attention (tensor-core bodies): the unpadded layout the bank model measures is conflicted",
          "[ops][attention][simt][banks]") {
  // The same model on the unpadded rows (kTcPad = 0), GPT-2's heads: the tiles'
  // rows share banks (8-way for ldmatrix, 4-way for 8-byte accumulator accesses).
  const LayoutWays w = layout_ways(64, 64, 0, TcAccumulators::shared);
  CHECK(w.tiles.ldsm_a == 8);
  CHECK(w.tiles.ldsm_bt == 8);
  CHECK(w.tiles.ldsm_b == 8);
  CHECK(w.tiles.acc == 4);
  // The old row phases walked row i in thread i: a warp reads one column of 32
  // rows of S, 64 floats apart, all in one bank.
  const simt::TcForwardSmem<uint16_t> f(nullptr, 64, 64, TcAccumulators::shared, 0);
  std::vector<unsigned char> buf(f.bytes);
  const simt::TcForwardSmem<uint16_t> s(buf.data(), 64, 64, TcAccumulators::shared, 0);
  Lanes column_of_S, column_of_P;
  for (int l = 0; l < 32; ++l) {
    column_of_S[static_cast<size_t>(l)] = offset_of(s.S + l * s.ld_t, buf.data());
    column_of_P[static_cast<size_t>(l)] = offset_of(s.P + l * s.ld_t, buf.data());
  }
  CHECK(testing::bank_ways(column_of_S, 4) == 32);
  CHECK(testing::bank_ways(column_of_P, 2) == 32);
}

TEST_CASE("attention (tensor cores, CUDA): register accumulators give the shared path's bits and match the CPU",
          "[ops][attention][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  struct GpuCase {
    int64_t B, T, Tk, H, Dk, Dv;
  };
  // GPT-2's heads, k3-small's MLA with cached keys, K3's MLA (its dK/dV kernel
  // keeps the shared path, its forward and dQ take registers).
  for (const GpuCase& c : {GpuCase{2, 100, 100, 3, 64, 64}, GpuCase{1, 37, 101, 2, 96, 64},
                           GpuCase{1, 130, 130, 2, 192, 128}}) {
    DYNAMIC_SECTION(fmt::format("B={} T={} Tk={} H={} Dk={} Dv={}", c.B, c.T, c.Tk, c.H, c.Dk, c.Dv)) {
      Tensor q = randn({c.B, c.T, c.H, c.Dk}, DType::f64, 21).to(DType::bf16);
      Tensor k = randn({c.B, c.Tk, c.H, c.Dk}, DType::f64, 22).to(DType::bf16);
      Tensor v = randn({c.B, c.Tk, c.H, c.Dv}, DType::f64, 23).to(DType::bf16);
      Tensor grad_o = randn({c.B, c.T, c.H, c.Dv}, DType::f64, 24).to(DType::bf16);
      const double scale = 1.5 / std::sqrt(static_cast<double>(c.Dk));
      auto run_gpu = [&](bool registers) {
        cuda::set_attention_register_accumulators(registers);
        CHECK(cuda::attention_tensor_cores_apply(q.to(kCuda), c.Dk, c.Dv));
        Tensor qg = q.to(kCuda).detach().set_requires_grad(), kg = k.to(kCuda).detach().set_requires_grad(),
               vg = v.to(kCuda).detach().set_requires_grad();
        Tensor o = causal_attention(qg, kg, vg, scale);
        o.backward(grad_o.to(kCuda));
        Outputs out{o.detach().to(kCpu).to(DType::f32), Tensor(), qg.grad().to(kCpu).to(DType::f32),
                    kg.grad().to(kCpu).to(DType::f32), vg.grad().to(kCpu).to(DType::f32)};
        cuda::set_attention_register_accumulators(true);
        return out;
      };
      const Outputs regs = run_gpu(true), shared = run_gpu(false);
      // The same f32 operations in the same order on the same tensor-core products.
      CHECK(testing::same_bits(regs.o, shared.o));
      CHECK(testing::same_bits(regs.grad_q, shared.grad_q));
      CHECK(testing::same_bits(regs.grad_k, shared.grad_k));
      CHECK(testing::same_bits(regs.grad_v, shared.grad_v));
      const Outputs ref = run_cpu(q, k, v, grad_o, scale);
      CHECK(rel_error(regs.o, ref.o) < 1e-2);
      CHECK(rel_error(regs.grad_v, ref.grad_v) < 2e-2);
      CHECK(rel_error(regs.grad_k, ref.grad_k) < 3e-2);
      CHECK(rel_error(regs.grad_q, ref.grad_q) < 3e-2);
    }
  }
}
