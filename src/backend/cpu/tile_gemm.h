// A register-blocked GEMM for small operands that already sit in L1/L2: the in-chunk
// products of the chunked KDA kernels (ops/kda/kda_cpu.cpp) and the per-expert products
// of small MoE experts (ops/moe/moe_cpu.cpp). docs/kernels.md describes both uses.
//
// Header-only templates, meant to be inlined into a caller compiled for the target
// ISA (a [[gnu::target(...), gnu::flatten]] function per copy, picked at run time by
// cpu::vector_isa(), backend/cpu/isa.h): Bytes = 32 for the portable and AVX2 copies,
// 64 for the AVX-512 copy.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "backend/cpu/blas.h"

namespace moetrain::cpu {

// C[m,n] = alpha op(A) op(B) + beta C (row-major, op(X) = X or X^T; beta = 0 never reads C)
// for small operands: KDA's chunk tiles (m, n, k <= max(C, K, V)) and small experts'
// products (rows x expert width). A BLAS spends as much time packing operands, scaling C
// and taking its buffer lock as multiplying at these sizes; here the operands already
// sit in L1/L2, so a register-blocked kernel reads them in place: 6 rows of C by NV
// vectors of columns in registers (enough independent FMAs to cover their latency),
// then 4 rows, 2, 1, op(A) broadcast element by element, op(B) rows loaded as vectors
// (B^T is first packed into `pack` [k, n]). The vectors are GCC vector extensions of
// Bytes bytes: 32 in the portable copy (two SSE2 registers) and the AVX2 copy (one
// register; NV = 2, 12 accumulators of 16 registers), 64 in the AVX-512 copy (one
// register; NV = 4, then 2, then 1; up to 24 accumulators of 32 registers). Shapes
// whose n is not a multiple of one vector go to cpu::gemm. Each C element is one
// in-order sum over p, whatever the blocking: deterministic, and the blocking does not
// change the bits (the vector width does not either: lanes are elements).
template <class T, int Bytes>
struct VecOf {
  typedef T type __attribute__((vector_size(Bytes)));
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> lane_int;
  typedef lane_int mask __attribute__((vector_size(Bytes)));
};
template <class T, int Bytes>
using Vec = typename VecOf<T, Bytes>::type;
template <class T>
using Vec32 = Vec<T, 32>;
template <class T>
using Vec32Of = VecOf<T, 32>;

// Unaligned vector load / store (memcpy compiles to one vmovups). By reference: a
// 32- or 64-byte vector passed by value has a different ABI with and without AVX.
template <class V, class T>
inline void load_vec(V& v, const T* p) {
  std::memcpy(&v, p, sizeof v);
}
template <class V, class T>
inline void store_vec(T* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// dst[c * ldd + i] = src[i * lds + c] for an 8x8 (f32) / 4x4 (f64) block: the unpack /
// shuffle / 128-bit-lane steps of the usual AVX transpose, as GCC shuffles.
inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
  using V = Vec32<float>;
  using M = Vec32Of<float>::mask;
  V r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) load_vec(r[i], src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shuffle(r[i], r[i + 1], M{0, 8, 1, 9, 4, 12, 5, 13});
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], M{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int h = 0; h < 8; h += 4)
    for (int i = 0; i < 2; ++i) {
      u[h + 2 * i] = __builtin_shuffle(t[h + i], t[h + i + 2], M{0, 1, 8, 9, 4, 5, 12, 13});
      u[h + 2 * i + 1] = __builtin_shuffle(t[h + i], t[h + i + 2], M{2, 3, 10, 11, 6, 7, 14, 15});
    }
  for (int c = 0; c < 4; ++c) {
    store_vec(dst + c * ldd, V(__builtin_shuffle(u[c], u[c + 4], M{0, 1, 2, 3, 8, 9, 10, 11})));
    store_vec(dst + (c + 4) * ldd, V(__builtin_shuffle(u[c], u[c + 4], M{4, 5, 6, 7, 12, 13, 14, 15})));
  }
}
inline void transpose_block(const double* src, int64_t lds, double* dst, int64_t ldd) {
  using V = Vec32<double>;
  using M = Vec32Of<double>::mask;
  V r[4], t[4];
  for (int i = 0; i < 4; ++i) load_vec(r[i], src + i * lds);
  for (int i = 0; i < 4; i += 2) {
    t[i] = __builtin_shuffle(r[i], r[i + 1], M{0, 4, 2, 6});
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], M{1, 5, 3, 7});
  }
  for (int c = 0; c < 2; ++c) {
    store_vec(dst + c * ldd, V(__builtin_shuffle(t[c], t[c + 2], M{0, 1, 4, 5})));
    store_vec(dst + (c + 2) * ldd, V(__builtin_shuffle(t[c], t[c + 2], M{2, 3, 6, 7})));
  }
}

// The same for a W x W block of 64-byte vectors (16x16 f32, 8x8 f64): log2(W) butterfly
// stages; at stage h, rows i and i + h (i & h = 0) swap their off-diagonal h-blocks.
// Two two-source shuffles per row pair and stage (vpermt2ps / vpermt2pd).
template <class V, class M, int W, int H, int... c>
inline void butterfly(V& x, V& y, std::integer_sequence<int, c...>) {
  V a = __builtin_shuffle(x, y, M{((c & H) == 0 ? c : W + c - H)...});
  V b = __builtin_shuffle(x, y, M{((c & H) == 0 ? c + H : W + c)...});
  x = a;
  y = b;
}
template <class T>
inline void transpose_block_wide(const T* src, int64_t lds, T* dst, int64_t ldd) {
  using V = Vec<T, 64>;
  using M = typename VecOf<T, 64>::mask;
  constexpr int W = 64 / sizeof(T);
  V r[W];
  for (int i = 0; i < W; ++i) load_vec(r[i], src + i * lds);
  auto stage = [&]<int H>(std::integral_constant<int, H>) {
    for (int i = 0; i < W; ++i)
      if (!(i & H)) butterfly<V, M, W, H>(r[i], r[i + H], std::make_integer_sequence<int, W>{});
  };
  if constexpr (W >= 16) stage(std::integral_constant<int, 8>{});
  stage(std::integral_constant<int, 4>{});
  stage(std::integral_constant<int, 2>{});
  stage(std::integral_constant<int, 1>{});
  for (int i = 0; i < W; ++i) store_vec(dst + i * ldd, r[i]);
}

// Which part of a product tile_gemm may skip: terms it knows are zero, or C entries
// nobody reads (docs/kernels.md, KDA, "Triangular products"; the MoE products use none). a_lower: op(A)[i,p] = 0
// for p > i; a_upper: op(A)[i,p] = 0 for p < i (so a row block of C sums only the
// p where its rows can be non-zero); c_lower: only C[i,j] with j <= i is wanted, so
// column vectors wholly right of a row block's last row are neither computed nor
// written (they keep whatever they held). Skipping a term a*b with a = ±0 changes no
// bits of a sum beyond the sign of an exact zero, so the results equal the full product's.
enum class Tri { none, a_lower, a_upper, c_lower };

// op(A)[i, p] = a[i * a_row + p * a_col]: (lda, 1), or (1, lda) when TransA. One of the
// two strides a compile-time 1, so that the compiler addresses op(A) without a multiply.
// Sums p in [p0, p1). With a factor array f (row stride ldc, as C), the product is
// scaled by it elementwise before beta C is added: C = alpha (op(A) op(B)) ⊙ F + beta C.
template <class T, int Bytes, bool TransA, int MR, int NV>
inline void tile_gemm_block(int64_t i0, int64_t j0, int64_t p0, int64_t p1, T alpha, const T* a, int64_t lda,
                            const T* b, int64_t ldb, T beta, T* c, int64_t ldc, const T* f) {
  using V = Vec<T, Bytes>;
  constexpr int64_t W = Bytes / sizeof(T);
  const int64_t a_row = TransA ? 1 : lda, a_col = TransA ? lda : 1;
  V acc[MR][NV] = {};
  const T* ap = a + i0 * a_row + p0 * a_col;
  const T* bp = b + p0 * ldb + j0;
  for (int64_t p = p0; p < p1; ++p, ap += a_col, bp += ldb) {
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) load_vec(bv[v], bp + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      T x = ap[r * a_row];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    T* c0 = c + (i0 + r) * ldc + j0;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      V y = alpha * acc[r][v];
      if (f) {
        V x;
        load_vec(x, f + (i0 + r) * ldc + j0 + v * W);
        y *= x;
      }
      if (beta != T(0)) {
        V x;
        load_vec(x, c0 + v * W);
        y += beta * x;
      }
      store_vec(c0 + v * W, y);
    }
  }
}

// Rows [i0, i0 + MR) of C, columns [0, n): blocks of NV vectors (NV = 4, then 2, only
// for 64-byte vectors), then of one vector.
template <class T, int Bytes, bool TransA, int MR>
inline void tile_gemm_rows(int64_t i0, int64_t n, int64_t p0, int64_t p1, T alpha, const T* a, int64_t lda,
                           const T* b, int64_t ldb, T beta, T* c, int64_t ldc, const T* f) {
  constexpr int64_t W = Bytes / sizeof(T), NV = Bytes == 64 ? 4 : 2;
  int64_t j0 = 0;
  for (; j0 + NV * W <= n; j0 += NV * W)
    tile_gemm_block<T, Bytes, TransA, MR, NV>(i0, j0, p0, p1, alpha, a, lda, b, ldb, beta, c, ldc, f);
  if constexpr (Bytes == 64)
    for (; j0 + 2 * W <= n; j0 += 2 * W)
      tile_gemm_block<T, Bytes, TransA, MR, 2>(i0, j0, p0, p1, alpha, a, lda, b, ldb, beta, c, ldc, f);
  for (; j0 < n; j0 += W)
    tile_gemm_block<T, Bytes, TransA, MR, 1>(i0, j0, p0, p1, alpha, a, lda, b, ldb, beta, c, ldc, f);
}

// Row block [i0, i0 + MR) under `tri`: the p range it sums and the columns it writes.
template <class T, int Bytes, bool TransA, int MR>
inline void tile_gemm_rows_tri(Tri tri, int64_t i0, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                               const T* b, int64_t ldb, T beta, T* c, int64_t ldc, const T* f) {
  constexpr int64_t W = Bytes / sizeof(T);
  int64_t p0 = 0, p1 = k, cols = n;
  if (tri == Tri::a_lower) p1 = std::min(k, i0 + MR);
  if (tri == Tri::a_upper) p0 = std::min(k, i0);
  if (tri == Tri::c_lower) cols = std::min(n, (i0 + MR + W - 1) / W * W);
  tile_gemm_rows<T, Bytes, TransA, MR>(i0, cols, p0, p1, alpha, a, lda, b, ldb, beta, c, ldc, f);
}

template <class T, int Bytes, bool TransA>
inline void tile_gemm_all_rows(Tri tri, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                               const T* b, int64_t ldb, T beta, T* c, int64_t ldc, const T* f) {
  int64_t i = 0;
  for (; i + 6 <= m; i += 6)
    tile_gemm_rows_tri<T, Bytes, TransA, 6>(tri, i, n, k, alpha, a, lda, b, ldb, beta, c, ldc, f);
  for (; i + 4 <= m; i += 4)
    tile_gemm_rows_tri<T, Bytes, TransA, 4>(tri, i, n, k, alpha, a, lda, b, ldb, beta, c, ldc, f);
  for (; i + 2 <= m; i += 2)
    tile_gemm_rows_tri<T, Bytes, TransA, 2>(tri, i, n, k, alpha, a, lda, b, ldb, beta, c, ldc, f);
  for (; i < m; ++i) tile_gemm_rows_tri<T, Bytes, TransA, 1>(tri, i, n, k, alpha, a, lda, b, ldb, beta, c, ldc, f);
}

// Whether tile_gemm multiplies an n-column op(B) itself (else it hands the product to cpu::gemm).
template <class T, int Bytes>
constexpr bool tile_gemm_takes(int64_t n, int64_t k) {
  constexpr int64_t W = Bytes / sizeof(T);
  return n % (Bytes == 64 ? W : 2 * W) == 0 && k > 0;
}

// pack[p, j] = b[j, p] for j < n, p < k (n a multiple of the vector): op(B) of a trans_b product.
template <class T, int Bytes>
inline void pack_transposed(const T* b, int64_t ldb, int64_t n, int64_t k, T* pack) {
  constexpr int64_t W = Bytes / sizeof(T);
  int64_t p0 = 0;
  for (; p0 + W <= k; p0 += W)
    for (int64_t j0 = 0; j0 < n; j0 += W) {
      if constexpr (Bytes == 64) transpose_block_wide(b + j0 * ldb + p0, ldb, pack + p0 * n + j0, n);
      else transpose_block(b + j0 * ldb + p0, ldb, pack + p0 * n + j0, n);
    }
  for (int64_t p = p0; p < k; ++p)
    for (int64_t j = 0; j < n; ++j) pack[p * n + j] = b[j * ldb + p];
}

template <class T, int Bytes>
inline void tile_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                      const T* b, int64_t ldb, T beta, T* c, int64_t ldc, T* pack, Tri tri = Tri::none,
                      const T* f = nullptr) {
  if (m <= 0 || n <= 0) return;
  if (!tile_gemm_takes<T, Bytes>(n, k)) {
    if (!f) {
      gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    // The product into `pack` ([m, n], m, n <= its side), then scaled and added.
    gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, T(0), pack, n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        T y = pack[i * n + j] * f[i * ldc + j];
        c[i * ldc + j] = beta != T(0) ? y + beta * c[i * ldc + j] : y;
      }
    return;
  }
  if (trans_b) {
    pack_transposed<T, Bytes>(b, ldb, n, k, pack);
    b = pack;
    ldb = n;
  }
  if (trans_a) tile_gemm_all_rows<T, Bytes, true>(tri, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, f);
  else tile_gemm_all_rows<T, Bytes, false>(tri, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, f);
}

}  // namespace moetrain::cpu
