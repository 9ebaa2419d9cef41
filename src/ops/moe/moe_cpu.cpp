// Grouped GEMMs: rows of expert e start at the prefix sum of counts. Two schedules,
// chosen from the shapes alone (never from the thread count, so the bits do not
// depend on it):
//  - small experts (k3-small: 64 experts of ~128 rows x 112 x 128, ~1.8M multiply-adds
//    each): each expert's product is one call of the register-blocked tile GEMM
//    (backend/cpu/tile_gemm.h: a BLAS packs both operands for every call, as much work
//    as the multiply at this size), and the experts are spread over the threads,
//    largest first, taken dynamically: one expert's GEMM is too small to split;
//  - larger experts: one after the other, each a cpu::gemm threaded by the route.
// The tile GEMM runs in the copy cpu::vector_isa() picks (AVX-512, AVX2 + FMA, or
// portable; backend/cpu/isa.h). Each output element is one in-order sum in either
// schedule (docs/kernels.md, MoE).
#include <algorithm>
#include <numeric>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/onednn.h"
#include "backend/cpu/tile_gemm.h"
#include "core/dispatch.h"
#include "core/parallel.h"
#include "ops/common/bf16_rows.h"
#include "ops/common/math.h"
#include "ops/moe/moe_kernels.h"

namespace moetrain::cpu {
namespace {

// Mean multiply-adds per expert (over experts with rows) below which the experts are
// "small": about two of the blis route's per-thread blocks (backend/cpu/blas.cpp).
constexpr double kSmallExpertMacs = 4e6;

// One product C = alpha op(A) op(B) + beta C of one expert.
struct Product {
  bool trans_a, trans_b;
  int64_t m, n, k;
  int64_t lda, ldb, ldc;
};

template <class T, int Bytes>
void tile_product(const Product& p, const T* a, const T* b, T* c, std::vector<T>& pack) {
  if (p.trans_b) pack.resize(static_cast<size_t>(p.n * p.k));
  tile_gemm<T, Bytes>(p.trans_a, p.trans_b, p.m, p.n, p.k, T(1), a, p.lda, b, p.ldb, T(0), c, p.ldc, pack.data());
}

// The AVX2 + FMA and AVX-512 copies (MT_TARGET_*: backend/cpu/isa.h). Not
// run_vector_isa: the copies differ in their vector width (Bytes), not only their target.
#if defined(__x86_64__) && defined(__GNUC__)
template <class T>
[[MT_TARGET_AVX2]] void tile_product_avx2(const Product& p, const T* a, const T* b, T* c, std::vector<T>& pack) {
  tile_product<T, 32>(p, a, b, c, pack);
}
template <class T>
[[MT_TARGET_AVX512]] void tile_product_avx512(const Product& p, const T* a, const T* b, T* c, std::vector<T>& pack) {
  tile_product<T, 64>(p, a, b, c, pack);
}
#else
template <class T>
void tile_product_avx2(const Product& p, const T* a, const T* b, T* c, std::vector<T>& pack) {
  tile_product<T, 32>(p, a, b, c, pack);
}
template <class T>
void tile_product_avx512(const Product& p, const T* a, const T* b, T* c, std::vector<T>& pack) {
  tile_product<T, 32>(p, a, b, c, pack);
}
#endif

// One expert's product: the tile GEMM in this CPU's copy (small experts), or cpu::gemm.
template <class T>
void expert_product(bool small, const Product& p, const T* a, const T* b, T* c) {
  if (!small) return gemm(p.trans_a, p.trans_b, p.m, p.n, p.k, T(1), a, p.lda, b, p.ldb, T(0), c, p.ldc);
  thread_local std::vector<T> pack;  // B^T of trans_b products
  switch (vector_isa()) {
    case VectorIsa::avx512:
      return tile_product_avx512(p, a, b, c, pack);
    case VectorIsa::avx2:
      return tile_product_avx2(p, a, b, c, pack);
    case VectorIsa::generic:
      return tile_product<T, 32>(p, a, b, c, pack);
  }
}

// Calls fn(e, first_row, small) for every expert with rows: spread over the threads
// when the experts are small, else in order on the calling thread (the header).
template <class F>
void for_each_expert(const std::vector<int64_t>& counts, double macs_per_row, F&& fn) {
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<int64_t> first(counts.size(), 0);
  for (int64_t e = 1; e < E; ++e) first[e] = first[e - 1] + counts[e - 1];
  std::vector<int64_t> busy;
  for (int64_t e = 0; e < E; ++e)
    if (counts[e] > 0) busy.push_back(e);
  if (busy.empty()) return;
  const int64_t rows = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const bool small = macs_per_row * static_cast<double>(rows) / static_cast<double>(busy.size()) < kSmallExpertMacs;
  const int64_t n = static_cast<int64_t>(busy.size());
  if (!small || n == 1 || num_threads() == 1 || omp_in_parallel()) {
    for (int64_t e : busy) fn(e, first[e], small);
    return;
  }
  std::stable_sort(busy.begin(), busy.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
#pragma omp parallel for num_threads(num_threads()) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) fn(busy[i], first[busy[i]], small);
}

}  // namespace

namespace {
// One expert's bf16 product through oneDNN (f32 accumulation, bf16 C rounded once);
// the expert's row count (m, or k for the weight gradient: rows_in_k) is a runtime
// dimension, so one primitive serves every count (onednn.h).
void expert_product_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                         const bf16* a, const bf16* b, bf16* c, bool rows_in_k = false) {
  onednn::MatmulShape s;
  s.trans_a = ta, s.trans_b = tb, s.m = m, s.n = n, s.k = k, s.lda = lda, s.ldb = ldb, s.ldc = ldc;
  s.runtime_m = !rows_in_k;
  s.runtime_k = rows_in_k;
  onednn::matmul(s, DType::bf16, a, b, DType::bf16, c);
}
}  // namespace

void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1);
  if (x.dtype() == DType::bf16) {
    const bf16* px = x.data<bf16>();
    const bf16* pw = w.data<bf16>();
    bf16* py = y.data<bf16>();
    for_each_expert(counts, static_cast<double>(in * out), [&](int64_t e, int64_t row, bool) {
      expert_product_bf16(false, true, counts[e], out, in, in, in, out, px + row * in, pw + e * out * in,
                          py + row * out);
    });
    return;
  }
  dispatch_float(x.dtype(), "grouped_linear", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    T* py = y.data<T>();
    for_each_expert(counts, static_cast<double>(in * out), [&](int64_t e, int64_t row, bool small) {
      // y_e [m, out] = x_e [m, in] w_e^T
      expert_product<T>(small, {false, true, counts[e], out, in, in, in, out}, px + row * in, pw + e * out * in,
                        py + row * out);
    });
  });
}

void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                             const std::vector<int64_t>& counts) {
  const int64_t in = x.size(1), out = w.size(1);
  if (x.dtype() == DType::bf16) {
    const bf16* px = x.data<bf16>();
    const bf16* pw = w.data<bf16>();
    const bf16* pdy = dy.data<bf16>();
    bf16* pdx = dx.data<bf16>();
    bf16* pdw = dw.data<bf16>();
    for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e)
      if (counts[e] == 0) std::fill(pdw + e * out * in, pdw + (e + 1) * out * in, bf16{});
    for_each_expert(counts, 2.0 * static_cast<double>(in * out), [&](int64_t e, int64_t row, bool) {
      const int64_t m = counts[e];
      expert_product_bf16(false, false, m, in, out, out, in, in, pdy + row * out, pw + e * out * in, pdx + row * in);
      expert_product_bf16(true, false, out, in, m, out, in, in, pdy + row * out, px + row * in, pdw + e * out * in,
                          true);
    });
    return;
  }
  dispatch_float(x.dtype(), "grouped_linear", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    T* pdw = dw.data<T>();
    for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e)
      if (counts[e] == 0) std::fill(pdw + e * out * in, pdw + (e + 1) * out * in, T(0));
    for_each_expert(counts, 2.0 * static_cast<double>(in * out), [&](int64_t e, int64_t row, bool small) {
      // dx_e [m, in] = dy_e [m, out] w_e [out, in];  dw_e [out, in] = dy_e^T x_e [m, in]
      const int64_t m = counts[e];
      expert_product<T>(small, {false, false, m, in, out, out, in, in}, pdy + row * out, pw + e * out * in,
                        pdx + row * in);
      expert_product<T>(small, {true, false, out, in, m, out, in, in}, pdy + row * out, px + row * in,
                        pdw + e * out * in);
    });
  });
}

namespace {
// The combine on bf16 rows and weights (ops/common/bf16_rows.h): each token's sum in an
// f32 row buffer from the widened rows and weights, rounded once into y; the backward
// widens the token's dy row and each slot's row, and rounds each gradient row and
// weight once. The f32 kernels' arithmetic in the same order: the bits of
// cpu::run_kernel's whole-tensor widening, without its f32 copies of rows, dy and
// grad_rows.
void moe_combine_forward_bf16(Tensor& y, const Tensor& rows, const Tensor& slot_rows, const Tensor& weights) {
  MT_CHECK(y.dtype() == DType::bf16 && weights.dtype() == DType::bf16, "moe_combine: bf16 rows {} with weights {}, y {}",
           describe(rows), describe(weights), describe(y));
  const int64_t M = rows.size(0), W = rows.size(1), N = weights.size(0), k = weights.size(1);
  const int64_t* idx = slot_rows.data<int64_t>();
  const bf16* pr = rows.data<bf16>();
  const bf16* pw = weights.data<bf16>();
  bf16* py = y.data<bf16>();
  parallel_for(N, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> yrow(static_cast<size_t>(W)), xrow(static_cast<size_t>(W));
    float* __restrict yn = yrow.data();
    float* __restrict x = xrow.data();
    for (int64_t n = lo; n < hi; ++n) {
      std::fill(yn, yn + W, 0.0f);
      for (int64_t s = 0; s < k; ++s) {
        const int64_t r = idx[n * k + s];
        if (r == M) continue;  // dropped
        const float w = pw[n * k + s].to_float();
        widen_bf16_row(x, pr + r * W, W);
        for (int64_t c = 0; c < W; ++c) yn[c] += w * x[c];
      }
      round_bf16_row(py + n * W, yn, W);
    }
  });
}

void moe_combine_backward_bf16(Tensor& grad_rows, Tensor& grad_weights, const Tensor& dy, const Tensor& rows,
                               const Tensor& slot_rows, const Tensor& weights) {
  MT_CHECK(grad_rows.dtype() == DType::bf16 && grad_weights.dtype() == DType::bf16 && dy.dtype() == DType::bf16 &&
               weights.dtype() == DType::bf16,
           "moe_combine_backward: bf16 rows {} with weights {}, dy {}, grad_rows {}, grad_weights {}", describe(rows),
           describe(weights), describe(dy), describe(grad_rows), describe(grad_weights));
  const int64_t M = rows.size(0), W = rows.size(1), N = weights.size(0), k = weights.size(1);
  const int64_t* idx = slot_rows.data<int64_t>();
  const bf16* pr = rows.data<bf16>();
  const bf16* pw = weights.data<bf16>();
  const bf16* pdy = dy.data<bf16>();
  bf16* gr = grad_rows.data<bf16>();
  bf16* gw = grad_weights.data<bf16>();
  parallel_for(N, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> grow(static_cast<size_t>(W)), xrow(static_cast<size_t>(W)), gxrow(static_cast<size_t>(W));
    float* __restrict g = grow.data();
    float* __restrict x = xrow.data();
    float* __restrict gx = gxrow.data();
    for (int64_t n = lo; n < hi; ++n) {
      widen_bf16_row(g, pdy + n * W, W);
      for (int64_t s = 0; s < k; ++s) {
        const int64_t r = idx[n * k + s];
        if (r == M) {
          gw[n * k + s] = bf16{};
          continue;
        }
        const float w = pw[n * k + s].to_float();
        widen_bf16_row(x, pr + r * W, W);
        for (int64_t c = 0; c < W; ++c) gx[c] = w * g[c];
        round_bf16_row(gr + r * W, gx, W);
        float acc[kLanes] = {};  // <x, g> in kLanes lanes, combined in a fixed order (ops/common/math.h)
        int64_t c = 0;
        for (; c + kLanes <= W; c += kLanes)
          for (int l = 0; l < kLanes; ++l) acc[l] += x[c + l] * g[c + l];
        float dot = 0.0f;
        for (; c < W; ++c) dot += x[c] * g[c];
        for (int l = 0; l < kLanes; ++l) dot += acc[l];
        gw[n * k + s] = bf16::from_float(dot);
      }
    }
  });
}
}  // namespace

// The combine: tokens in parallel, each token's slots in order. Every row is named by
// at most one slot (moe_combine checks), so the backward's row writes never meet.
void moe_combine_forward(Tensor& y, const Tensor& rows, const Tensor& slot_rows, const Tensor& weights) {
  if (rows.dtype() == DType::bf16) return moe_combine_forward_bf16(y, rows, slot_rows, weights);
  const int64_t M = rows.size(0), W = rows.size(1), N = weights.size(0), k = weights.size(1);
  const int64_t* idx = slot_rows.data<int64_t>();
  dispatch_float(rows.dtype(), "moe_combine", [&](auto tag) {
    using T = decltype(tag);
    const T* pr = rows.data<T>();
    const T* pw = weights.data<T>();
    T* py = y.data<T>();
    parallel_for(N, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t n = lo; n < hi; ++n) {
        T* __restrict yn = py + n * W;
        std::fill(yn, yn + W, T(0));
        for (int64_t s = 0; s < k; ++s) {
          const int64_t r = idx[n * k + s];
          if (r == M) continue;  // dropped
          const T w = pw[n * k + s];
          const T* __restrict x = pr + r * W;
          for (int64_t c = 0; c < W; ++c) yn[c] += w * x[c];
        }
      }
    });
  });
}

void moe_combine_backward(Tensor& grad_rows, Tensor& grad_weights, const Tensor& dy, const Tensor& rows,
                          const Tensor& slot_rows, const Tensor& weights) {
  if (rows.dtype() == DType::bf16) return moe_combine_backward_bf16(grad_rows, grad_weights, dy, rows, slot_rows, weights);
  const int64_t M = rows.size(0), W = rows.size(1), N = weights.size(0), k = weights.size(1);
  const int64_t* idx = slot_rows.data<int64_t>();
  dispatch_float(rows.dtype(), "moe_combine_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* pr = rows.data<T>();
    const T* pw = weights.data<T>();
    const T* pdy = dy.data<T>();
    T* gr = grad_rows.data<T>();
    T* gw = grad_weights.data<T>();
    parallel_for(N, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t n = lo; n < hi; ++n) {
        const T* __restrict g = pdy + n * W;
        for (int64_t s = 0; s < k; ++s) {
          const int64_t r = idx[n * k + s];
          if (r == M) {
            gw[n * k + s] = T(0);
            continue;
          }
          const T w = pw[n * k + s];
          const T* __restrict x = pr + r * W;
          T* __restrict gx = gr + r * W;
          for (int64_t c = 0; c < W; ++c) gx[c] = w * g[c];
          T acc[kLanes] = {};  // <x, g> in kLanes lanes, combined in a fixed order (ops/common/math.h)
          int64_t c = 0;
          for (; c + kLanes <= W; c += kLanes)
            for (int l = 0; l < kLanes; ++l) acc[l] += x[c + l] * g[c + l];
          T dot = T(0);
          for (; c < W; ++c) dot += x[c] * g[c];
          for (int l = 0; l < kLanes; ++l) dot += acc[l];
          gw[n * k + s] = dot;
        }
      }
    });
  });
}

}  // namespace moetrain::cpu
