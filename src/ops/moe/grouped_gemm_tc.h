// The MoE experts' grouped GEMMs on tensor cores, for bf16, reading the experts'
// row offsets from device memory (no host wait for the counts): the bodies of
// the kernels in grouped_gemm_tc_cuda.cu, written once for the GPU and the host
// (ops/common/simt.h; the tile seam, HostMma and DeviceMma, is
// ops/common/tc_mma.h), so tests/ops/moe/grouped_gemm_tc_test.cpp runs these very
// bodies on the CPU. docs/cuda.md, "Grouped expert GEMM on tensor cores".
//
// Layout (as moe.h's grouped_linear): x [M, in], w [E, out, in], offsets i64
// [E + 1] (offsets[0] = 0, non-decreasing, offsets[E] <= M): expert e's rows are
// [offsets[e], offsets[e + 1]); rows from offsets[E] on are padding.
//   forward:  y_rows(e) = x_rows(e) w[e]ᵀ       (padding rows of y = 0)
//   data:     dx_rows(e) = dy_rows(e) w[e]      (padding rows of dx = 0)
//   weight:   dw[e] = dy_rows(e)ᵀ x_rows(e)     (dw[e] = 0 for an expert without rows)
// Every product: bf16 operands, f32 sums in a fixed order (the k chunks of 64
// in order, in each the four 16-wide mma steps in order), one rounding to bf16
// at the store; no atomics, so a run repeats itself bit for bit.
//
// A block of 4 warps computes a 64x64 tile of the output; warp w owns its rows
// 16w..16w+15 as four 16x16 accumulator fragments in registers (TcFrags). Per
// chunk of 64 along k the block stages both operands into shared memory (rows
// padded by kTcPad: conflict-free ldmatrix) with 16-byte cp.async copies where
// a row's length is a multiple of 8 elements and the tensor 16-byte aligned, and
// element by element otherwise; every element outside the operand (a row past
// the expert's end, a column past in or out) is staged as zero, so in, out and
// the counts may be anything. The products, with k the summed index:
//   forward: A = x rows (row-major, tc_ldsm_a), B given as Bᵀ = w[e] rows
//            (tc_ldsm_bt); k = in.
//   data:    A = dy rows (tc_ldsm_a), B = w[e] row-major [out][in] (.trans,
//            tc_ldsm_b); k = out.
//   weight:  A = dyᵀ, stored as dy's rows [rows][out] (A column-major: .trans,
//            tc_ldsm_at), B = x rows row-major [rows][in] (tc_ldsm_b); k = the
//            expert's rows.
// Row tiles of the forward and data products (grid.x): expert e has
// ceil(count_e / 64) of them, in expert order; the total is at most
// ceil(M / 64) + E (each ceiling adds less than one tile), a bound the host
// knows without reading the offsets, so the grid has that many slots. A block
// finds its (expert, first row) from the offsets (gg_find_tile: each of the 128
// threads sums the tiles of ceil(E / 128) experts, 7 at E = 896, then each
// finds whether the slot is in its experts). Slots past the experts' total
// zero the padding rows, 64 a slot (the padding needs at most the remaining
// slots: the E + 1 ceilings of the experts and the padding exceed ceil(M / 64)
// by at most E); later slots do nothing. Staging and compute are not
// overlapped (one buffer a operand; the GPU hides the wait with other blocks).
// grid.y: the output's column tiles. The weight product: grid (E, out tiles, in
// tiles), each block looping over its expert's rows 64 at a time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/common/simt.h"
#include "ops/common/tc_mma.h"

namespace moetrain::simt {

inline constexpr int kGgTile = 64;  // output rows and columns of a block; k per staged chunk
inline constexpr int kGgWarps = 4;  // warp w owns output rows 16w..16w+15
inline constexpr int kGgThreads = 32 * kGgWarps;
inline constexpr int kGgFrags = kGgTile / 16;  // a warp's 16x16 accumulators across the tile's columns

// Row-tile slots of the forward and data grids: enough for every expert's
// tiles and the padding's, whatever the offsets (header comment).
MT_HOST_DEVICE inline int64_t gg_row_slots(int64_t M, int64_t E) { return (M + kGgTile - 1) / kGgTile + E; }
MT_HOST_DEVICE inline int64_t gg_tiles(int64_t n) { return (n + kGgTile - 1) / kGgTile; }

// Shapes, inputs and outputs of one call; T is the bf16 storage type.
template <class T>
struct GgArgs {
  int64_t M = 0, in = 0, out = 0, E = 0;
  const int64_t* offsets = nullptr;  // [E + 1], in the memory the body runs in (the GPU's on the GPU)
  const T *x = nullptr, *w = nullptr, *dy = nullptr;
  T *y = nullptr, *dx = nullptr, *dw = nullptr;
};

// A block's shared memory: the two staged operands (64 rows of 64 + kTcPad),
// the f32 rows that carry the accumulators out, and the tile search's scratch.
template <class E>
struct GgSmem {
  static constexpr int ld = kGgTile + kTcPad;    // A and B rows (bf16: 144 bytes)
  static constexpr int ld_c = kGgTile + kTcPad;  // C rows (f32)
  E *A, *B;
  float* C;
  int64_t* part;  // [kGgThreads]: tiles of each thread's experts
  int64_t* tile;  // [3]: the slot's expert (-1: padding), first row, end row
  size_t bytes;
  MT_HOST_DEVICE explicit GgSmem(unsigned char* base) {
    Carver c{base};
    A = c.take<E>(kGgTile * ld);
    B = c.take<E>(kGgTile * ld);
    C = c.take<float>(kGgTile * ld_c);
    part = c.take<int64_t>(kGgThreads);
    tile = c.take<int64_t>(3);
    bytes = c.used;
  }
};

// Where a row-tile slot of the forward/data grid lands.
struct GgTile {
  int64_t expert;  // >= 0: rows [row0, row_end) of this expert (row_end - row0 <= 64); -1: padding rows to zero
  int64_t row0, row_end;
};

// Slot `slot` of the row tiles (header comment): thread t sums the tiles of
// experts [t·per, (t + 1)·per), then each thread starts from the sum of the
// threads before it and walks its experts; exactly one thread writes the
// answer (the one whose experts hold the slot, or the last thread when the slot
// is past every expert's tiles: padding).
MT_SIMT_BODY
template <class Blk>
MT_HOST_DEVICE GgTile gg_find_tile(const Blk& blk, const int64_t* offsets, int64_t E, int64_t M, int64_t slot,
                                   int64_t* part, int64_t* tile) {
  const int n = blk.threads;
  const int64_t per = (E + n - 1) / n;
  blk.each([&](int tid) {
    int64_t sum = 0;
    for (int64_t e = tid * per; e < E && e < (tid + 1) * per; ++e) sum += gg_tiles(offsets[e + 1] - offsets[e]);
    part[tid] = sum;
  });
  blk.each([&](int tid) {
    int64_t start = 0;
    for (int t = 0; t < tid; ++t) start += part[t];
    for (int64_t e = tid * per; e < E && e < (tid + 1) * per; ++e) {
      const int64_t tiles = gg_tiles(offsets[e + 1] - offsets[e]);
      if (slot >= start && slot < start + tiles) {
        const int64_t row0 = offsets[e] + (slot - start) * kGgTile;
        tile[0] = e;
        tile[1] = row0;
        tile[2] = min_i(row0 + kGgTile, offsets[e + 1]);
      }
      start += tiles;
    }
    if (tid == n - 1 && slot >= start) {  // start: every expert's tiles
      const int64_t row0 = min_i(offsets[E] + (slot - start) * kGgTile, M);
      tile[0] = -1;
      tile[1] = row0;
      tile[2] = min_i(row0 + kGgTile, M);
    }
  });
  return GgTile{tile[0], tile[1], tile[2]};
}

// Stages a 64x64 operand chunk into dst (row stride ld): element (i, j) =
// src[(r0 + i) · cols + c0 + j] where r0 + i < r_end and c0 + j < cols, 0
// elsewhere. src is row-major with `cols` columns. 16-byte asynchronous copies
// (M::copy8) where cols is a multiple of 8 and src 16-byte aligned (then a chunk
// of 8 is all in or all out), element by element otherwise.
MT_SIMT_BODY
template <class M, class Blk, class T>
MT_HOST_DEVICE void gg_stage(const Blk& blk, typename M::E* dst, int ld, const T* src, int64_t cols, int64_t r0,
                             int64_t r_end, int64_t c0) {
  const int n = blk.threads;
  if (cols % kTcChunk == 0 && tc_aligned16(src)) {
    blk.each([&](int tid) {
      for (int e = tid; e < kGgTile * kGgTile / kTcChunk; e += n) {
        const TcCell x = tc_chunk(e, kGgTile);
        const int64_t r = r0 + x.row, c = c0 + x.col;
        if (r < r_end && c < cols)
          M::copy8(dst + x.row * ld + x.col, src + r * cols + c);
        else
          M::zero8(dst + x.row * ld + x.col);
      }
      M::copy_wait();
    });
    return;
  }
  blk.each([&](int tid) {
    for (int e = tid; e < kGgTile * kGgTile; e += n) {
      const TcCell x = tc_cell(e, kGgTile);
      const int64_t r = r0 + x.row, c = c0 + x.col;
      dst[x.row * ld + x.col] = M::operand(r < r_end && c < cols ? widen(src[r * cols + c]) : 0.0f);
    }
  });
}

// Zeroes rows [row0, row_end) x columns [c0, c0 + 64) ∩ [0, cols) of a
// row-major [.., cols] tensor (the padding rows of y or dx).
MT_SIMT_BODY
template <class Blk, class T>
MT_HOST_DEVICE void gg_zero_rows(const Blk& blk, T* dst, int64_t cols, int64_t row0, int64_t row_end, int64_t c0) {
  const int n = blk.threads;
  blk.each([&](int tid) {
    for (int e = tid; e < kGgTile * kGgTile; e += n) {
      const TcCell x = tc_cell(e, kGgTile);
      const int64_t r = row0 + x.row, c = c0 + x.col;
      if (r < row_end && c < cols) narrow(dst[r * cols + c], 0.0f);
    }
  });
}

// Which operand layouts a product's chunk takes (header comment).
enum class GgProduct { forward, data, weight };

// acc (warp w's 16 rows x 64 columns) += A_w B over one staged chunk of k = 64.
MT_SIMT_BODY
template <class M, GgProduct P>
MT_HOST_DEVICE void gg_chunk(TcFrags<M, kGgFrags>& acc, const typename M::E* A, const typename M::E* B, int ld,
                             int w) {
MT_UNROLL
  for (int kk = 0; kk < kGgTile; kk += 16) {
    typename M::TileA a;
    if constexpr (P == GgProduct::weight)
      M::load_at(a, A + kk * ld + 16 * w, ld);  // A(i, k) = dy[k][i]
    else
      M::load_a(a, A + 16 * w * ld + kk, ld);
MT_UNROLL
    for (int j = 0; j < kGgFrags; ++j) {
      if constexpr (P == GgProduct::forward) {
        typename M::TileBt b;
        M::load_bt(b, B + 16 * j * ld + kk, ld);  // B(k, j) = w[e][j][k]
        M::mma(acc.f[j], a, b);
      } else {
        typename M::TileB b;
        M::load_b(b, B + kk * ld + 16 * j, ld);  // B(k, j) stored [k][j]
        M::mma(acc.f[j], a, b);
      }
    }
  }
}

// y (forward) or dx (data) for row-tile slot `slot`, column tile `col_tile`.
MT_SIMT_BODY
template <class M, GgProduct P, class Blk, class T>
MT_HOST_DEVICE void gg_rows_product(const Blk& blk, const GgArgs<T>& a, int64_t slot, int64_t col_tile,
                                    unsigned char* smem) {
  static_assert(P != GgProduct::weight, "the weight product has its own body");
  constexpr bool kForward = P == GgProduct::forward;
  const GgSmem<typename M::E> s(smem);
  const int64_t cols = kForward ? a.out : a.in, K = kForward ? a.in : a.out;
  T* dst = kForward ? a.y : a.dx;
  const T* rows = kForward ? a.x : a.dy;  // A's source, [M, K]
  const int64_t c0 = col_tile * kGgTile;
  const GgTile t = gg_find_tile(blk, a.offsets, a.E, a.M, slot, s.part, s.tile);
  if (t.expert < 0) {
    gg_zero_rows(blk, dst, cols, t.row0, t.row_end, c0);
    return;
  }
  const T* we = a.w + t.expert * a.out * a.in;  // w[e] [out, in]
  typename Blk::template PerWarp<TcFrags<M, kGgFrags>> acc(blk);
  blk.each_warp([&](int w) { tc_zero_frags(acc.at(w)); });
  for (int64_t k0 = 0; k0 < K; k0 += kGgTile) {
    gg_stage<M>(blk, s.A, s.ld, rows, K, t.row0, t.row_end, k0);
    if constexpr (kForward)
      gg_stage<M>(blk, s.B, s.ld, we, a.in, c0, a.out, k0);  // Bᵀ: w[e] rows c0.., columns k0..
    else
      gg_stage<M>(blk, s.B, s.ld, we, a.in, k0, a.out, c0);  // B: w[e] rows k0.., columns c0..
    blk.each_warp([&](int w) { gg_chunk<M, P>(acc.at(w), s.A, s.B, s.ld, w); });
  }
  blk.each_warp([&](int w) {
    tc_store_frags<M>(blk, acc.at(w), s.C + 16 * w * s.ld_c, s.ld_c, [&](int r, int c, float x) {
      const int64_t row = t.row0 + 16 * w + r, col = c0 + c;
      if (row < t.row_end && col < cols) narrow(dst[row * cols + col], x);
    });
  });
}

// dw[e] rows (out) o_tile·64.., columns (in) i_tile·64..: the expert's rows summed
// 64 at a time in order.
MT_SIMT_BODY
template <class M, class Blk, class T>
MT_HOST_DEVICE void gg_weight_product(const Blk& blk, const GgArgs<T>& a, int64_t e, int64_t o_tile, int64_t i_tile,
                                      unsigned char* smem) {
  const GgSmem<typename M::E> s(smem);
  const int64_t o0 = o_tile * kGgTile, i0 = i_tile * kGgTile, begin = a.offsets[e], end = a.offsets[e + 1];
  typename Blk::template PerWarp<TcFrags<M, kGgFrags>> acc(blk);
  blk.each_warp([&](int w) { tc_zero_frags(acc.at(w)); });
  for (int64_t r0 = begin; r0 < end; r0 += kGgTile) {
    gg_stage<M>(blk, s.A, s.ld, a.dy, a.out, r0, end, o0);  // Aᵀ: dy rows r0.., columns o0..
    gg_stage<M>(blk, s.B, s.ld, a.x, a.in, r0, end, i0);    // B: x rows r0.., columns i0..
    blk.each_warp([&](int w) { gg_chunk<M, GgProduct::weight>(acc.at(w), s.A, s.B, s.ld, w); });
  }
  T* dwe = a.dw + e * a.out * a.in;
  blk.each_warp([&](int w) {
    tc_store_frags<M>(blk, acc.at(w), s.C + 16 * w * s.ld_c, s.ld_c, [&](int r, int c, float x) {
      const int64_t o = o0 + 16 * w + r, i = i0 + c;
      if (o < a.out && i < a.in) narrow(dwe[o * a.in + i], x);
    });
  });
}

}  // namespace moetrain::simt
