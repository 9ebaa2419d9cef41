// The MoE grouped GEMM bodies on tensor cores (ops/moe/grouped_gemm_tc.h), run on
// the host block by block as grouped_gemm_tc_cuda.cu launches them (HostBlock,
// HostMma standing in for ldmatrix and mma.m16n8k16: the bodies' lane maps, the
// new column-major A map of the weight gradient included, fed to a model of the
// instructions written from PTX's fragment tables), against a float64 product of
// the same bf16 inputs and against the CPU kernels (cpu::grouped_linear_*,
// counts from the offsets). What a GPU run adds (the [cuda] case): the launch,
// cp.async, the hardware itself and its summation order inside a 16-wide step.
//
// Tolerance against float64, per output element with K terms a_k b_k: the
// bodies sum in f32 in a fixed order and round once to bf16, so
//   |got - ref| <= 2^-8 |ref| + (1 + 2^-8) K 2^-24 sum_k |a_k b_k|
// (bf16's unit roundoff 2^-8; f32's recursive-summation bound K 2^-24). The CPU
// kernels meet the same bound, so the two may differ by twice it.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <vector>

#include "moetrain.h"
#include "ops/moe/grouped_gemm_tc.h"
#include "ops/moe/grouped_gemm_tc_kernels.h"
#include "ops/moe/moe_kernels.h"
#include "ops/simt_orders.h"
#include "ops/smem_banks.h"
#include "testing.h"

using namespace moetrain;
using simt::HostOrder;

namespace {

struct GgCase {
  std::vector<int64_t> counts;  // rows per expert
  int64_t padding;              // rows after the experts'
  int64_t in, out;
};

struct GgData {
  int64_t M, E, in, out;
  std::vector<int64_t> counts, offsets;
  Tensor x, w, dy;  // bf16 on the CPU
};

GgData gg_data(const GgCase& c, uint64_t seed) {
  GgData d;
  d.counts = c.counts;
  d.E = static_cast<int64_t>(c.counts.size());
  d.offsets.assign(1, 0);
  for (int64_t n : c.counts) d.offsets.push_back(d.offsets.back() + n);
  d.M = d.offsets.back() + c.padding;
  d.in = c.in;
  d.out = c.out;
  d.x = randn({d.M, d.in}, DType::f32, seed).to(DType::bf16);
  d.w = randn({d.E, d.out, d.in}, DType::f32, seed + 1).to(DType::bf16);
  d.dy = randn({d.M, d.out}, DType::f32, seed + 2).to(DType::bf16);
  return d;
}

struct GgOutputs {
  Tensor y, dx, dw;  // bf16
};
bool same_bits(const GgOutputs& a, const GgOutputs& b) {
  return testing::same_bits({&a.y, &a.dx, &a.dw}, {&b.y, &b.dx, &b.dw});
}

// The three bodies on the host over the grids grouped_gemm_tc_cuda.cu launches;
// outputs start as NaN, so an element no block writes shows.
GgOutputs gg_run_host(const GgData& d, HostOrder order) {
  GgOutputs o{full({d.M, d.out}, std::nan(""), DType::bf16), full({d.M, d.in}, std::nan(""), DType::bf16),
              full({d.E, d.out, d.in}, std::nan(""), DType::bf16)};
  simt::GgArgs<bf16> a;
  a.M = d.M;
  a.in = d.in;
  a.out = d.out;
  a.E = d.E;
  a.offsets = d.offsets.data();
  a.x = d.x.data<bf16>();
  a.w = d.w.data<bf16>();
  a.dy = d.dy.data<bf16>();
  a.y = o.y.data<bf16>();
  a.dx = o.dx.data<bf16>();
  a.dw = o.dw.data<bf16>();
  const simt::HostBlock blk = testing::host_block(simt::kGgThreads, order);
  std::vector<unsigned char> smem(simt::GgSmem<float>(nullptr).bytes);
  // Every block starts on garbage (NaN operands, -1 counts), as on a GPU.
  auto body = [&](auto&& run) {
    std::fill(smem.begin(), smem.end(), static_cast<unsigned char>(0xff));
    run();
  };
  const int64_t slots = d.M > 0 ? simt::gg_row_slots(d.M, d.E) : 0;
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t c = 0; c < simt::gg_tiles(d.out); ++c)
      body([&] { simt::gg_rows_product<simt::HostMma, simt::GgProduct::forward>(blk, a, s, c, smem.data()); });
    for (int64_t c = 0; c < simt::gg_tiles(d.in); ++c)
      body([&] { simt::gg_rows_product<simt::HostMma, simt::GgProduct::data>(blk, a, s, c, smem.data()); });
  }
  for (int64_t e = 0; e < d.E; ++e)
    for (int64_t ot = 0; ot < simt::gg_tiles(d.out); ++ot)
      for (int64_t it = 0; it < simt::gg_tiles(d.in); ++it)
        body([&] { simt::gg_weight_product<simt::HostMma>(blk, a, e, ot, it, smem.data()); });
  return o;
}

// The float64 products of the bf16 inputs: value and sum |a b| per element.
struct GgRef {
  std::vector<double> v, abs;
};
struct GgRefs {
  GgRef y, dx, dw;
};
GgRefs gg_reference(const GgData& d) {
  const std::vector<double> x = d.x.to_vector(), w = d.w.to_vector(), dy = d.dy.to_vector();
  const int64_t M = d.M, in = d.in, out = d.out;
  GgRefs r;
  r.y = {std::vector<double>(M * out), std::vector<double>(M * out)};
  r.dx = {std::vector<double>(M * in), std::vector<double>(M * in)};
  r.dw = {std::vector<double>(d.E * out * in), std::vector<double>(d.E * out * in)};
  for (int64_t e = 0; e < d.E; ++e) {
    const double* we = w.data() + e * out * in;
    for (int64_t row = d.offsets[e]; row < d.offsets[e + 1]; ++row) {
      for (int64_t j = 0; j < out; ++j)
        for (int64_t k = 0; k < in; ++k) {
          const double p = x[row * in + k] * we[j * in + k];
          r.y.v[row * out + j] += p;
          r.y.abs[row * out + j] += std::abs(p);
        }
      for (int64_t i = 0; i < in; ++i)
        for (int64_t k = 0; k < out; ++k) {
          const double p = dy[row * out + k] * we[k * in + i];
          r.dx.v[row * in + i] += p;
          r.dx.abs[row * in + i] += std::abs(p);
        }
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const double p = dy[row * out + o] * x[row * in + i];
          r.dw.v[(e * out + o) * in + i] += p;
          r.dw.abs[(e * out + o) * in + i] += std::abs(p);
        }
    }
  }
  return r;
}

// The bound of the header comment on element i of ref, K terms.
double gg_bound(const GgRef& ref, size_t i, int64_t K) {
  return std::ldexp(std::abs(ref.v[i]), -8) +
         (1 + std::ldexp(1.0, -8)) * static_cast<double>(K) * std::ldexp(ref.abs[i], -24);
}

// The largest |got - ref| / bound over elements [first, last) (NaN: infinite).
double gg_worst_ratio(const std::vector<double>& got, const GgRef& ref, int64_t K, size_t first = 0,
                   size_t last = SIZE_MAX) {
  double worst = 0;
  for (size_t i = first; i < std::min(last, got.size()); ++i) {
    const double r = std::isnan(got[i]) ? INFINITY : std::abs(got[i] - ref.v[i]) / (gg_bound(ref, i, K) + 1e-30);
    worst = std::max(worst, r);
  }
  return worst;
}

// The largest |a - b| / (2 bound) over elements [0, last): two results that each
// meet the bound.
double gg_worst_between(const std::vector<double>& a, const std::vector<double>& b, const GgRef& ref, int64_t K,
                     size_t last = SIZE_MAX) {
  double worst = 0;
  for (size_t i = 0; i < std::min(last, a.size()); ++i) {
    const double d = a[i] - b[i];
    worst = std::max(worst, std::isnan(d) ? INFINITY : std::abs(d) / (2 * gg_bound(ref, i, K) + 1e-30));
  }
  return worst;
}

bool gg_all_zero(const std::vector<double>& v, size_t first, size_t last) {
  for (size_t i = first; i < last; ++i)
    if (v[i] != 0.0 || std::signbit(v[i])) return false;
  return true;
}

// The host bodies against float64 and the CPU kernels; padding rows and empty
// experts exactly zero.
void gg_check_case(const GgCase& c, uint64_t seed) {
  const GgData d = gg_data(c, seed);
  INFO("E " << d.E << ", M " << d.M << " (experts' rows " << d.offsets.back() << "), in " << d.in << ", out "
            << d.out);
  const GgOutputs o = gg_run_host(d, HostOrder::natural);
  const GgRefs r = gg_reference(d);
  const std::vector<double> y = o.y.to_vector(), dx = o.dx.to_vector(), dw = o.dw.to_vector();
  const size_t N = static_cast<size_t>(d.offsets.back());
  CHECK(gg_worst_ratio(y, r.y, d.in, 0, N * d.out) <= 1.0);
  CHECK(gg_worst_ratio(dx, r.dx, d.out, 0, N * d.in) <= 1.0);
  int64_t most_rows = 0;
  for (int64_t n : d.counts) most_rows = std::max(most_rows, n);
  CHECK(gg_worst_ratio(dw, r.dw, most_rows) <= 1.0);
  CHECK(gg_all_zero(y, N * d.out, y.size()));  // padding rows
  CHECK(gg_all_zero(dx, N * d.in, dx.size()));
  for (int64_t e = 0; e < d.E; ++e)
    if (d.counts[e] == 0) {
      INFO("expert " << e << " has no rows");
      CHECK(gg_all_zero(dw, e * d.out * d.in, (e + 1) * d.out * d.in));
    }
  // The CPU kernels on the same bf16 inputs (they leave the padding rows alone).
  Tensor cy = zeros({d.M, d.out}, DType::bf16), cdx = zeros({d.M, d.in}, DType::bf16),
         cdw = zeros({d.E, d.out, d.in}, DType::bf16);
  cpu::grouped_linear_forward(cy, d.x, d.w, d.counts);
  cpu::grouped_linear_backward(cdx, cdw, d.dy, d.x, d.w, d.counts);
  const std::vector<double> vy = cy.to_vector(), vdx = cdx.to_vector(), vdw = cdw.to_vector();
  CHECK(gg_worst_between(y, vy, r.y, d.in, N * d.out) <= 1.0);
  CHECK(gg_worst_between(dx, vdx, r.dx, d.out, N * d.in) <= 1.0);
  CHECK(gg_worst_between(dw, vdw, r.dw, most_rows, SIZE_MAX) <= 1.0);
}

}  // namespace

TEST_CASE("grouped_gemm_tc: the column-major A map gives ldmatrix.trans and mma the tile's elements", "[ops][moe][simt]") {
  // tc_ldsm_at fed to HostMma's ldmatrix(.trans) and mma models (PTX's fragment
  // tables) must give D = A B for A stored transposed (At[k][i] = A(i, k)), as
  // tc_ldsm_a does for A stored as is. Small integers: exact in any order.
  constexpr int ld = 24, ldc = 20;  // padded strides, as the bodies use
  std::vector<float> A(16 * ld), At(16 * ld), B(16 * ld), D(16 * ldc), D_at(16 * ldc);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      A[i * ld + j] = static_cast<float>((i * 7 + j * 3) % 9 - 4);
      At[j * ld + i] = A[i * ld + j];
      B[i * ld + j] = static_cast<float>((i * 5 + j * 11) % 7 - 3);
    }
  simt::HostMma::TileA a, at;
  simt::HostMma::TileB b;
  simt::HostMma::load_a(a, A.data(), ld);
  simt::HostMma::load_at(at, At.data(), ld);
  simt::HostMma::load_b(b, B.data(), ld);
  simt::HostMma::Acc acc, acc_at;
  simt::HostMma::zero(acc);
  simt::HostMma::zero(acc_at);
  simt::HostMma::mma(acc, a, b);
  simt::HostMma::mma(acc_at, at, b);
  simt::HostMma::store_acc(D.data(), acc, ldc);
  simt::HostMma::store_acc(D_at.data(), acc_at, ldc);
  int wrong = 0;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = 0;
      for (int k = 0; k < 16; ++k) s += A[i * ld + k] * B[k * ld + j];
      wrong += (D[i * ldc + j] != s) + (D_at[i * ldc + j] != s);
    }
  CHECK(wrong == 0);
  // Every register of every lane: the element PTX's A fragment table puts there.
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < 2; ++h) {
        const int row = lane / 4 + 8 * (r % 2), col = 2 * (lane % 4) + h + 8 * (r / 2);
        CHECK(at.v[lane][2 * r + h] == A[row * ld + col]);
      }
}

TEST_CASE("grouped_gemm_tc: host bodies match float64 and the CPU kernels; padding and empty experts are zero",
          "[ops][moe][simt]") {
  // Counts with 0 rows, 1 row, multiples of 64 and not; padding after the experts;
  // in/out multiples of 16 (16-byte copies), of 8 but not 16, and odd (element staging).
  const std::vector<GgCase> cases = {
      {{70}, 5, 16, 48},
      {{0, 1, 130}, 0, 48, 80},
      {{64, 0, 17, 1, 128, 65, 0, 3}, 40, 80, 16},
      {{5, 0, 70}, 3, 21, 37},
      {{0, 0}, 10, 24, 40},
      {{0, 0, 0, 0}, 0, 16, 16},  // M = 0: every dw[e] is zero
      {{2, 66}, 1, 7, 130},
  };
  uint64_t seed = 100;
  for (const GgCase& c : cases) gg_check_case(c, seed += 10);
  // 64 experts, mostly small, some empty (the k3-small shape, scaled down).
  std::vector<int64_t> counts(64);
  for (int64_t e = 0; e < 64; ++e) counts[e] = (e * 37 + 11) % 23 == 0 ? 0 : (e * 29 + 5) % 21;
  gg_check_case({counts, 7, 16, 32}, 7);
  // 896 experts (7 a thread in the tile search), most without rows.
  std::vector<int64_t> many(896, 0);
  for (int64_t e = 0; e < 896; e += 13) many[e] = e % 5 + 1;
  many[895] = 70;
  gg_check_case({many, 3, 16, 16}, 9);
}

TEST_CASE("grouped_gemm_tc: the tile search gives every expert row and padding row to one slot", "[ops][moe][simt]") {
  // E up to 896 (more experts than threads: 7 a thread), counts including 0.
  for (int64_t E : {1, 3, 8, 64, 127, 128, 129, 896}) {
    std::vector<int64_t> offsets{0};
    for (int64_t e = 0; e < E; ++e) offsets.push_back(offsets.back() + ((e * 131 + E) % 7 == 0 ? 0 : (e * 53 + 3) % 150));
    for (int64_t padding : {0, 1, 64, 200}) {
      const int64_t M = offsets.back() + padding;
      std::vector<int> owner_expert(static_cast<size_t>(M), -2), seen(static_cast<size_t>(M), 0);
      int64_t part[simt::kGgThreads], tile[3];
      // The search in one thread order, its shared arrays holding garbage first
      // (as a GPU block's shared memory does): a phase that reads what another
      // thread writes in it gives another answer in another order.
      auto find = [&](int64_t s, HostOrder order) {
        std::fill(std::begin(part), std::end(part), int64_t{1} << 40);
        std::fill(std::begin(tile), std::end(tile), int64_t{-7});
        return simt::gg_find_tile(testing::host_block(simt::kGgThreads, order), offsets.data(), E, M, s, part, tile);
      };
      for (int64_t s = 0; s < simt::gg_row_slots(M, E); ++s) {
        const simt::GgTile t = find(s, HostOrder::natural);
        for (HostOrder order : {HostOrder::reversed, HostOrder::shuffled}) {
          const simt::GgTile o = find(s, order);
          REQUIRE((o.expert == t.expert && o.row0 == t.row0 && o.row_end == t.row_end));
        }
        REQUIRE(t.row0 <= t.row_end);
        REQUIRE(t.row_end - t.row0 <= simt::kGgTile);
        for (int64_t r = t.row0; r < t.row_end; ++r) {
          ++seen[static_cast<size_t>(r)];
          owner_expert[static_cast<size_t>(r)] = static_cast<int>(t.expert);
        }
      }
      INFO("E " << E << ", padding " << padding);
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) CHECK((owner_expert[r] == e && seen[r] == 1));
      for (int64_t r = offsets.back(); r < M; ++r) CHECK((owner_expert[r] == -1 && seen[r] == 1));
    }
  }
}

TEST_CASE("grouped_gemm_tc: host bodies give the same bits in every thread order", "[ops][moe][simt]") {
  const GgData d = gg_data({{3, 0, 70, 64}, 9, 40, 24}, 5);
  testing::run_in_all_orders([&](HostOrder order) { return gg_run_host(d, order); });
}

TEST_CASE("grouped_gemm_tc: CUDA entry points match the CPU kernels, offsets on the device", "[ops][moe][cuda]") {
  if (!testing::gpu_available()) return;
  for (const GgCase& c : {GgCase{{64, 0, 17, 1, 128, 65, 0, 3}, 40, 80, 48}, GgCase{{5, 0, 70}, 3, 21, 37},
                          GgCase{{0, 0}, 0, 16, 16}}) {
    const GgData d = gg_data(c, 31);
    const GgRefs r = gg_reference(d);
    INFO("E " << d.E << ", M " << d.M << ", in " << d.in << ", out " << d.out);
    Tensor offsets = from_vector(std::vector<double>(d.offsets.begin(), d.offsets.end()), {d.E + 1}, DType::i64)
                         .to(kCuda);
    Tensor x = d.x.to(kCuda), w = d.w.to(kCuda), dy = d.dy.to(kCuda);
    auto run = [&] {
      GgOutputs o{full({d.M, d.out}, std::nan(""), DType::bf16, kCuda),
                  full({d.M, d.in}, std::nan(""), DType::bf16, kCuda),
                  full({d.E, d.out, d.in}, std::nan(""), DType::bf16, kCuda)};
      cuda::grouped_linear_forward_dev(o.y, x, w, offsets);
      cuda::grouped_linear_backward_dev(o.dx, o.dw, dy, x, w, offsets);
      return GgOutputs{o.y.to(kCpu), o.dx.to(kCpu), o.dw.to(kCpu)};
    };
    const GgOutputs a = run(), b = run();
    CHECK(same_bits(a, b));  // no atomics: the same bits run to run
    const std::vector<double> y = a.y.to_vector(), dx = a.dx.to_vector(), dw = a.dw.to_vector();
    const size_t N = static_cast<size_t>(d.offsets.back());
    int64_t most_rows = 0;
    for (int64_t n : d.counts) most_rows = std::max(most_rows, n);
    CHECK(gg_worst_ratio(y, r.y, d.in, 0, N * d.out) <= 1.0);
    CHECK(gg_worst_ratio(dx, r.dx, d.out, 0, N * d.in) <= 1.0);
    CHECK(gg_worst_ratio(dw, r.dw, most_rows) <= 1.0);
    CHECK(gg_all_zero(y, N * d.out, y.size()));
    CHECK(gg_all_zero(dx, N * d.in, dx.size()));
    for (int64_t e = 0; e < d.E; ++e)
      if (d.counts[e] == 0) CHECK(gg_all_zero(dw, e * d.out * d.in, (e + 1) * d.out * d.in));
    // The CPU kernels on the same bf16 inputs: each within the bound, so within twice it of each other.
    Tensor cy = zeros({d.M, d.out}, DType::bf16), cdx = zeros({d.M, d.in}, DType::bf16),
           cdw = zeros({d.E, d.out, d.in}, DType::bf16);
    cpu::grouped_linear_forward(cy, d.x, d.w, d.counts);
    cpu::grouped_linear_backward(cdx, cdw, d.dy, d.x, d.w, d.counts);
    CHECK(gg_worst_between(y, cy.to_vector(), r.y, d.in, N * d.out) <= 1.0);
    CHECK(gg_worst_between(dx, cdx.to_vector(), r.dx, d.out, N * d.in) <= 1.0);
    CHECK(gg_worst_between(dw, cdw.to_vector(), r.dw, most_rows) <= 1.0);
  }
}

namespace {

// Bank ways (tests/ops/smem_banks.h's model) of the bodies' shared accesses for
// operand rows of `ld` bf16 and accumulator rows of `ld_c` f32: the worst over
// every warp, every 16-wide k step and fragment.
struct GgBankWays {
  int ldsm_a = 1, ldsm_at = 1, ldsm_bt = 1, ldsm_b = 1, staging = 1, acc_store = 1, acc_read = 1;
};
GgBankWays gg_layout_ways(int ld, int ld_c) {
  using testing::bank_ways;
  GgBankWays g;
  auto ldsm = [&](simt::TcRC (*map)(int), int base_elems) {
    std::array<int64_t, 32> bytes{};
    for (int lane = 0; lane < 32; ++lane) {
      const simt::TcRC c = map(lane);
      bytes[static_cast<size_t>(lane)] = 2 * (base_elems + c.row * ld + c.col);
    }
    return bank_ways(bytes, 16);
  };
  for (int w = 0; w < simt::kGgWarps; ++w)
    for (int kk = 0; kk < simt::kGgTile; kk += 16) {
      g.ldsm_a = std::max(g.ldsm_a, ldsm(simt::tc_ldsm_a, 16 * w * ld + kk));
      g.ldsm_at = std::max(g.ldsm_at, ldsm(simt::tc_ldsm_at, kk * ld + 16 * w));
      for (int j = 0; j < simt::kGgFrags; ++j) {
        g.ldsm_bt = std::max(g.ldsm_bt, ldsm(simt::tc_ldsm_bt, 16 * j * ld + kk));
        g.ldsm_b = std::max(g.ldsm_b, ldsm(simt::tc_ldsm_b, kk * ld + 16 * j));
      }
    }
  // Staging (16-byte copies): warp w's lanes take chunks 32w + lane, + 128, ...
  for (int e0 = 0; e0 < simt::kGgTile * simt::kGgTile / simt::kTcChunk; e0 += 32) {
    std::array<int64_t, 32> bytes{};
    for (int lane = 0; lane < 32; ++lane) {
      const simt::TcCell x = simt::tc_chunk(e0 + lane, simt::kGgTile);
      bytes[static_cast<size_t>(lane)] = 2 * (x.row * ld + x.col);
    }
    g.staging = std::max(g.staging, bank_ways(bytes, 16));
  }
  // Accumulators out: store_acc's 8-byte pairs, then the lanes along a row.
  for (int w = 0; w < simt::kGgWarps; ++w)
    for (int jj = 0; jj < 4; ++jj)
      for (int e = 0; e < simt::kTcAccRegs; e += 2) {
        std::array<int64_t, 32> bytes{};
        for (int lane = 0; lane < 32; ++lane) {
          const simt::TcRC c = simt::tc_acc_cell(lane, e);
          bytes[static_cast<size_t>(lane)] = 4 * (16 * w * ld_c + 16 * jj + c.row * ld_c + c.col);
        }
        g.acc_store = std::max(g.acc_store, bank_ways(bytes, 8));
      }
  for (int r = 0; r < 16; ++r)
    for (int c0 = 0; c0 < simt::kGgTile; c0 += 32) {
      std::array<int64_t, 32> bytes{};
      for (int lane = 0; lane < 32; ++lane) bytes[static_cast<size_t>(lane)] = 4 * (r * ld_c + c0 + lane);
      g.acc_read = std::max(g.acc_read, bank_ways(bytes, 4));
    }
  return g;
}

}  // namespace

TEST_CASE("grouped_gemm_tc: shared-memory accesses are free of bank conflicts; unpadded rows are not",
          "[ops][moe][simt][banks]") {
  using Smem = simt::GgSmem<bf16>;
  const GgBankWays g = gg_layout_ways(Smem::ld, Smem::ld_c);
  CHECK(g.ldsm_a == 1);
  CHECK(g.ldsm_at == 1);
  CHECK(g.ldsm_bt == 1);
  CHECK(g.ldsm_b == 1);
  CHECK(g.staging == 1);
  CHECK(g.acc_store == 1);
  CHECK(g.acc_read == 1);
  // The model can fail: rows of 64 elements put an ldmatrix phase's 8 rows on one bank group.
  const GgBankWays u = gg_layout_ways(simt::kGgTile, simt::kGgTile);
  CHECK(u.ldsm_a == 8);
  CHECK(u.ldsm_at == 8);
  CHECK(u.acc_store > 1);
}
