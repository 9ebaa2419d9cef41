// 16x16x8 TF32 tensor-core tiles (f32 accumulation) for bodies written once
// for the GPU and the host (ops/common/simt.h): DeviceTf32 is wmma (sm_80 and later),
// HostTf32 the same products on the host, operands rounded to TF32 as the GPU's
// conversion rounds them, so host tests see the GPU's operand rounding (not its
// order of summation inside a tile). tile_mma runs one tile's sum over k,
// warp_tiles deals a product's tiles out to the warps.
// Used by the chunked KDA bodies (kda_tc.h, kda_simt.h's kda_chunk_grad).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops/common/simt.h"

#if defined(__CUDACC__)
#include <mma.h>
#endif

namespace moetrain::simt {

// The host's TF32 tensor core: D += A B on 16x16x8 tiles, operands rounded to
// TF32 as the GPU's conversion rounds them (to nearest, ties away from zero),
// products and sums in f32, in k order.
struct HostTf32 {
  struct TileA {
    float x[16][8];
  };
  using TileAt = TileA;
  struct TileB {
    float x[8][16];
  };
  using TileBt = TileB;
  struct Acc {
    float x[16][16];
  };

  static float round(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u) return f;  // inf, NaN
    bits = (bits + 0x1000u) & 0xffffe000u;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  // A (16 x 8), row-major: (i, k) at p[i * ld + k].
  static void load_a(TileA& t, const float* p, int64_t ld) {
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 8; ++k) t.x[i][k] = round(p[i * ld + k]);
  }
  // A given as Aᵀ row-major (column-major A): (i, k) at p[k * ld + i].
  static void load_at(TileAt& t, const float* p, int64_t ld) {
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 8; ++k) t.x[i][k] = round(p[k * ld + i]);
  }
  static void negate(TileA& t) {
    for (auto& row : t.x)
      for (float& v : row) v = -v;
  }
  // B (8 x 16), row-major: (k, j) at p[k * ld + j].
  static void load_b(TileB& t, const float* p, int64_t ld) {
    for (int k = 0; k < 8; ++k)
      for (int j = 0; j < 16; ++j) t.x[k][j] = round(p[k * ld + j]);
  }
  // B given as Bᵀ row-major (column-major B): (k, j) at p[j * ld + k].
  static void load_bt(TileBt& t, const float* p, int64_t ld) {
    for (int k = 0; k < 8; ++k)
      for (int j = 0; j < 16; ++j) t.x[k][j] = round(p[j * ld + k]);
  }
  static void zero(Acc& t) {
    for (auto& row : t.x)
      for (float& v : row) v = 0.0f;
  }
  static void load_acc(Acc& t, const float* p, int64_t ld) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) t.x[i][j] = p[i * ld + j];
  }
  static void store_acc(float* p, const Acc& t, int64_t ld) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) p[i * ld + j] = t.x[i][j];
  }
  static void mma(Acc& d, const TileA& a, const TileB& b) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        float s = d.x[i][j];
        for (int k = 0; k < 8; ++k) s += a.x[i][k] * b.x[k][j];
        d.x[i][j] = s;
      }
  }
};

#if defined(__CUDACC__)
// The GPU's: wmma 16x16x8 TF32 -> f32 (sm_80 and later), operands converted
// after the load. Warp-collective; pointers 32-byte aligned, ld a multiple of 4.
struct DeviceTf32 {
  using P = nvcuda::wmma::precision::tf32;
  using TileA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 8, P, nvcuda::wmma::row_major>;
  using TileAt = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 8, P, nvcuda::wmma::col_major>;
  using TileB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 8, P, nvcuda::wmma::row_major>;
  using TileBt = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 8, P, nvcuda::wmma::col_major>;
  using Acc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float>;

  template <class F>
  __device__ static void to_tf32(F& t) {
    for (int e = 0; e < t.num_elements; ++e) t.x[e] = nvcuda::wmma::__float_to_tf32(t.x[e]);
  }
  __device__ static void load_a(TileA& t, const float* p, int64_t ld) {
    nvcuda::wmma::load_matrix_sync(t, p, static_cast<unsigned>(ld));
    to_tf32(t);
  }
  __device__ static void load_at(TileAt& t, const float* p, int64_t ld) {
    nvcuda::wmma::load_matrix_sync(t, p, static_cast<unsigned>(ld));
    to_tf32(t);
  }
  template <class F>
  __device__ static void negate(F& t) {
    for (int e = 0; e < t.num_elements; ++e) t.x[e] = -t.x[e];
  }
  __device__ static void load_b(TileB& t, const float* p, int64_t ld) {
    nvcuda::wmma::load_matrix_sync(t, p, static_cast<unsigned>(ld));
    to_tf32(t);
  }
  __device__ static void load_bt(TileBt& t, const float* p, int64_t ld) {
    nvcuda::wmma::load_matrix_sync(t, p, static_cast<unsigned>(ld));
    to_tf32(t);
  }
  __device__ static void zero(Acc& t) { nvcuda::wmma::fill_fragment(t, 0.0f); }
  __device__ static void load_acc(Acc& t, const float* p, int64_t ld) {
    nvcuda::wmma::load_matrix_sync(t, p, static_cast<unsigned>(ld), nvcuda::wmma::mem_row_major);
  }
  __device__ static void store_acc(float* p, const Acc& t, int64_t ld) {
    nvcuda::wmma::store_matrix_sync(p, t, static_cast<unsigned>(ld), nvcuda::wmma::mem_row_major);
  }
  template <class TA, class TB>
  __device__ static void mma(Acc& d, const TA& a, const TB& b) {
    nvcuda::wmma::mma_sync(d, a, b, d);
  }
};
#endif

// acc += op(X) op(Y) over k in [k0, k1) (k0, k1 multiples of 8) for one 16x16
// tile: X's 16 rows at x, row-major (x[i * ldx + k]) or, x_t, given transposed
// (x[k * ldx + i]); Y's 16 columns at y, row-major (y[k * ldy + j]) or, y_t,
// given transposed (y[j * ldy + k]); negate: -X. Warp-collective on the GPU.
MT_SIMT_BODY
template <class M, bool x_t = false, bool y_t = false>
MT_HOST_DEVICE void tile_mma(typename M::Acc& acc, const float* x, int64_t ldx, const float* y, int64_t ldy,
                             int64_t k0, int64_t k1, bool negate = false) {
  for (int64_t kk = k0; kk < k1; kk += 8) {
    std::conditional_t<x_t, typename M::TileAt, typename M::TileA> a;
    std::conditional_t<y_t, typename M::TileBt, typename M::TileB> b;
    if constexpr (x_t)
      M::load_at(a, x + kk * ldx, ldx);
    else
      M::load_a(a, x + kk, ldx);
    if (negate) M::negate(a);
    if constexpr (y_t)
      M::load_bt(b, y + kk, ldy);
    else
      M::load_b(b, y + kk * ldy, ldy);
    M::mma(acc, a, b);
  }
}

// f(r, c) for the 16x16 tiles (first row r, first column c) of a rows x cols
// output that warp w of `warps` owns: round robin over the tiles in row-major
// order, continued from `first`, so several products of one phase share it out
// as one list. Returns first + the tile count (the next product's first).
template <class F>
MT_HOST_DEVICE int64_t warp_tiles(int w, int warps, int64_t rows, int64_t cols, F&& f, int64_t first = 0) {
  const int64_t ct = cols / 16, count = rows / 16 * ct;
  for (int64_t u = ((w - first) % warps + warps) % warps; u < count; u += warps) f(u / ct * 16, u % ct * 16);
  return first + count;
}

}  // namespace moetrain::simt
