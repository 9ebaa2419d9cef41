// Causal attention on tensor cores, for bf16 (FlashAttention-2's tiling): the
// bodies of the kernels in attention_tc_cuda.cu, written once for the GPU and
// the host (ops/common/simt.h). Scores, probabilities and gradients are products of
// 16x16x16 tiles: bf16 operands, f32 accumulation (wmma on the GPU, HostMma
// on the host: the same operands, rounded to bf16 the same way, summed in
// f32), so tests/ops/attention/attention_tc_test.cpp runs these very bodies on the CPU
// against the CPU attention kernels.
//
// A block of 4 warps takes a tile of 64 query rows (forward, dQ) or 64 keys
// (dK/dV); warp w owns rows (keys) 16w..16w+15 of it. Per tile of the other
// side, in phases:
//   forward: S = Q Kᵀ (warps) -> online softmax, P in bf16, O rescaled
//            (warp w's lanes along each of its rows) -> O += P V (warps)
//   dK, dV:  Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (warps) -> Pᵀ = e^{scale Sᵀ - lse},
//            dSᵀ = Pᵀ (dPᵀ - delta) in bf16 (every thread, elementwise) ->
//            dV += Pᵀ dO, dK += dSᵀ Q (warps)
//   dQ:      S = Q Kᵀ, dP = dO Vᵀ -> dS -> dQ += dS K
// Shared rows are padded (kTcPad) and a warp's lanes walk rows along their
// columns, so no phase has bank conflicts in the model of tests/ops/smem_banks.h
// (docs/cuda.md, "Attention on tensor cores").
// Accumulators (O, dK, dV, dQ) live in f32 shared memory between phases (the
// softmax rescales O's rows, which a register fragment cannot expose); every
// sum runs in a fixed order, so a run repeats itself bit for bit. delta =
// rowsum(dO ⊙ O) comes from attention_cuda.cu's kernel. Layout as in
// attention_cuda.cu: q [B, T, H, Dk], k [B, Tk, H, Dk], v [B, Tk, H, Dv];
// query t sits at position off + t (off = Tk - T) and sees keys s <= off + t.
// Head dims: multiples of 16, at most 256 (the GPU's shared memory decides
// whether a shape runs here or on the scalar kernels).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "ops/common/simt.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace moetrain::simt {

inline constexpr int kTcTile = 64;  // query rows and keys per tile
inline constexpr int kTcWarps = 4;  // warp w owns rows 16w..16w+15 of a tile
inline constexpr int kTcThreads = 32 * kTcWarps;
inline constexpr int kTcMaxDim = 256;
// Every shared row is padded by kTcPad elements (docs/cuda.md, "Attention on tensor
// cores"): 16 bytes on a bf16 row, 32 on an f32 row. With dim a multiple of 16,
// a row of dim + 8 elements is an odd multiple of 4 banks (bf16) or of 8 banks
// (f32) modulo 32, so 8 consecutive bf16 rows start in the 8 different groups of
// 4 banks (4 f32 rows in the 4 groups of 8): the rows a tile access reads
// together fall on different banks. dim + 8 is still a multiple of 8 elements
// (wmma's ldm) and every tile 32-byte aligned. kTcPad = 0 gives the unpadded
// layout, which the bank tests compare with.
inline constexpr int kTcPad = 8;

// The host's tensor core: D += A B on 16x16 tiles of operands already rounded
// to bf16 (held as float), products and sums in f32 in k order.
struct HostMma {
  using E = float;  // an operand in shared memory
  struct Tile {
    float x[16][16];
  };
  using TileA = Tile;   // A, row-major: (i, k) at p[i * ld + k]
  using TileBt = Tile;  // B given as Bᵀ row-major: (k, j) at p[j * ld + k]
  using TileB = Tile;   // B, row-major: (k, j) at p[k * ld + j]
  using Acc = Tile;     // f32, row-major

  static E operand(float f) { return moetrain::bf16::from_float(f).to_float(); }
  static void load_a(TileA& t, const E* p, int ld) {
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 16; ++k) t.x[i][k] = p[i * ld + k];
  }
  static void load_bt(TileBt& t, const E* p, int ld) {
    for (int k = 0; k < 16; ++k)
      for (int j = 0; j < 16; ++j) t.x[k][j] = p[j * ld + k];
  }
  static void load_b(TileB& t, const E* p, int ld) {
    for (int k = 0; k < 16; ++k)
      for (int j = 0; j < 16; ++j) t.x[k][j] = p[k * ld + j];
  }
  static void zero(Acc& t) {
    for (auto& row : t.x)
      for (float& v : row) v = 0.0f;
  }
  static void load_acc(Acc& t, const float* p, int ld) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) t.x[i][j] = p[i * ld + j];
  }
  static void store_acc(float* p, const Acc& t, int ld) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) p[i * ld + j] = t.x[i][j];
  }
  static void mma(Acc& d, const Tile& a, const Tile& b) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        float s = d.x[i][j];
        for (int k = 0; k < 16; ++k) s += a.x[i][k] * b.x[k][j];
        d.x[i][j] = s;
      }
  }
};

inline float widen(moetrain::bf16 x) { return x.to_float(); }
inline void narrow(moetrain::bf16& dst, float f) { dst = moetrain::bf16::from_float(f); }

#if defined(__CUDACC__)
// The GPU's: wmma 16x16x16 bf16 -> f32 (sm_80 and later). Warp-collective.
struct DeviceMma {
  using E = __nv_bfloat16;
  using TileA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, E, nvcuda::wmma::row_major>;
  using TileBt = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, E, nvcuda::wmma::col_major>;
  using TileB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, E, nvcuda::wmma::row_major>;
  using Acc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;

  __device__ static E operand(float f) { return __float2bfloat16_rn(f); }
  __device__ static void load_a(TileA& t, const E* p, int ld) { nvcuda::wmma::load_matrix_sync(t, p, ld); }
  __device__ static void load_bt(TileBt& t, const E* p, int ld) { nvcuda::wmma::load_matrix_sync(t, p, ld); }
  __device__ static void load_b(TileB& t, const E* p, int ld) { nvcuda::wmma::load_matrix_sync(t, p, ld); }
  __device__ static void zero(Acc& t) { nvcuda::wmma::fill_fragment(t, 0.0f); }
  __device__ static void load_acc(Acc& t, const float* p, int ld) {
    nvcuda::wmma::load_matrix_sync(t, p, ld, nvcuda::wmma::mem_row_major);
  }
  __device__ static void store_acc(float* p, const Acc& t, int ld) {
    nvcuda::wmma::store_matrix_sync(p, t, ld, nvcuda::wmma::mem_row_major);
  }
  template <class B>
  __device__ static void mma(Acc& d, const TileA& a, const B& b) {
    nvcuda::wmma::mma_sync(d, a, b, d);
  }
};

__device__ inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline void narrow(__nv_bfloat16& dst, float f) { dst = __float2bfloat16_rn(f); }
#endif

MT_HOST_DEVICE inline int64_t min_i(int64_t a, int64_t b) { return a < b ? a : b; }
MT_HOST_DEVICE inline int64_t max_i(int64_t a, int64_t b) { return a > b ? a : b; }

// Shapes, inputs and outputs of one attention call; T is the bf16 storage type.
template <class T>
struct TcAttention {
  int64_t B = 0, Tq = 0, Tk = 0, off = 0, H = 0;
  int Dk = 0, Dv = 0;
  float scale = 1;
  const T *q = nullptr, *k = nullptr, *v = nullptr, *grad_o = nullptr;
  T *o = nullptr, *grad_q = nullptr, *grad_k = nullptr, *grad_v = nullptr;
  float* lse = nullptr;           // [B, H, Tq]: written by the forward, read by the backward
  const float* delta = nullptr;   // [B, H, Tq]: rowsum(dO ⊙ O), backward

  // Element (b, t, h, 0) of q/o (queries) or k/v (keys), in rows of the head dim.
  MT_HOST_DEVICE int64_t query_row(int64_t b, int64_t t, int64_t h) const { return (b * Tq + t) * H + h; }
  MT_HOST_DEVICE int64_t key_row(int64_t b, int64_t s, int64_t h) const { return (b * Tk + s) * H + h; }
};

// Carves a kernel's shared memory into arrays (128-byte aligned). With a null
// base it only counts: the launcher sizes the allocation with the same code.
struct Carver {
  unsigned char* base;
  size_t used = 0;
  template <class X>
  MT_HOST_DEVICE X* take(int64_t count) {
    used = (used + 127) / 128 * 128;
    X* p = base ? reinterpret_cast<X*>(base + used) : nullptr;
    used += static_cast<size_t>(count) * sizeof(X);
    return p;
  }
};

// Row strides (elements) of the shared arrays: ld_k for rows of Dk (Q, K, dQ,
// dK), ld_v for rows of Dv (V, dO, O, dV), ld_t for rows of a tile (S, P, dP, dS).
struct TcStrides {
  int ld_k, ld_v, ld_t;
  MT_HOST_DEVICE TcStrides(int Dk, int Dv, int pad) : ld_k(Dk + pad), ld_v(Dv + pad), ld_t(kTcTile + pad) {}
};

template <class E>
struct TcForwardSmem : TcStrides {
  E *Q, *K, *V, *P;
  float *S, *O, *m, *l;
  size_t bytes;
  MT_HOST_DEVICE TcForwardSmem(unsigned char* base, int Dk, int Dv, int pad = kTcPad) : TcStrides(Dk, Dv, pad) {
    Carver c{base};
    Q = c.take<E>(kTcTile * ld_k);
    K = c.take<E>(kTcTile * ld_k);
    V = c.take<E>(kTcTile * ld_v);
    P = c.take<E>(kTcTile * ld_t);
    S = c.take<float>(kTcTile * ld_t);
    O = c.take<float>(kTcTile * ld_v);
    m = c.take<float>(kTcTile);
    l = c.take<float>(kTcTile);
    bytes = c.used;
  }
};

// The backward kernels' arrays; dX is the accumulated gradient (dK and dV for
// the key-tile kernel, dQ in dX_k for the query-tile kernel).
template <class E>
struct TcBackwardSmem : TcStrides {
  E *Q, *K, *V, *dO, *P, *dS;
  float *S, *dP, *dXk, *dXv, *lse, *delta;
  size_t bytes;
  MT_HOST_DEVICE TcBackwardSmem(unsigned char* base, int Dk, int Dv, bool key_tile, int pad = kTcPad)
      : TcStrides(Dk, Dv, pad) {
    Carver c{base};
    Q = c.take<E>(kTcTile * ld_k);
    K = c.take<E>(kTcTile * ld_k);
    V = c.take<E>(kTcTile * ld_v);
    dO = c.take<E>(kTcTile * ld_v);
    P = key_tile ? c.take<E>(kTcTile * ld_t) : nullptr;
    dS = c.take<E>(kTcTile * ld_t);
    S = c.take<float>(kTcTile * ld_t);
    dP = c.take<float>(kTcTile * ld_t);
    dXk = c.take<float>(kTcTile * ld_k);
    dXv = key_tile ? c.take<float>(kTcTile * ld_v) : nullptr;
    lse = c.take<float>(kTcTile);
    delta = c.take<float>(kTcTile);
    bytes = c.used;
  }
};

// The row phases use every thread of the block, and a warp's lanes touch
// consecutive elements of a row (docs/cuda.md, "Attention on tensor cores"):
//   elementwise phases (staging, zeroing, P and dS in the backward, the stores):
//     thread tid takes elements e = tid, tid + threads, ... of a [kTcTile][dim]
//     tile, cell tc_cell(e, dim);
//   the forward's softmax: warp w walks its own rows 16w..16w+15 one at a time,
//     lane taking columns tc_lane_col(lane, j), j < kTcTile / 32; the row's max and
//     sum are warp_max/warp_sum (simt.h).
struct TcCell {
  int row, col;
};
MT_HOST_DEVICE inline TcCell tc_cell(int e, int dim) { return {e / dim, e % dim}; }
MT_HOST_DEVICE inline int tc_lane_col(int lane, int j) { return lane + 32 * j; }
inline constexpr int kTcLaneCols = kTcTile / 32;

// Rows first..first+63 of a [.., H, dim] tensor (row index of (b, t, h) =
// row0 + t·H; rows >= limit read as 0) into dst as operands, row stride ld.
MT_SIMT_BODY
template <class M, class Blk, class T>
MT_HOST_DEVICE void tc_stage(const Blk& blk, typename M::E* dst, int ld, const T* src, int64_t row0, int64_t H,
                             int64_t first, int64_t limit, int dim) {
  const int n = blk.threads;
  blk.each([&](int tid) {
    for (int e = tid; e < kTcTile * dim; e += n) {
      const TcCell x = tc_cell(e, dim);
      const int64_t t = first + x.row;
      dst[x.row * ld + x.col] = M::operand(t < limit ? widen(src[(row0 + t * H) * dim + x.col]) : 0.0f);
    }
  });
}

// Zeroes a [kTcTile][dim] f32 array of row stride ld.
MT_SIMT_BODY
template <class Blk>
MT_HOST_DEVICE void tc_zero(const Blk& blk, float* dst, int ld, int dim) {
  const int n = blk.threads;
  blk.each([&](int tid) {
    for (int e = tid; e < kTcTile * dim; e += n) {
      const TcCell x = tc_cell(e, dim);
      dst[x.row * ld + x.col] = 0.0f;
    }
  });
}

// out[16 rows of warp w][64] = X_w Yᵀ: X [64][dim] and Y [64][dim] row-major
// operands of row stride ld (Y's rows are the columns of the product); out's
// row stride is ld_out.
MT_SIMT_BODY
template <class M>
MT_HOST_DEVICE void tc_rows_times_rows(float* out, int ld_out, const typename M::E* X, const typename M::E* Y, int ld,
                                       int dim, int w) {
  for (int j = 0; j < kTcTile; j += 16) {
    typename M::Acc acc;
    M::zero(acc);
    for (int kk = 0; kk < dim; kk += 16) {
      typename M::TileA x;
      typename M::TileBt y;
      M::load_a(x, X + 16 * w * ld + kk, ld);
      M::load_bt(y, Y + j * ld + kk, ld);
      M::mma(acc, x, y);
    }
    M::store_acc(out + 16 * w * ld_out + j, acc, ld_out);
  }
}

// acc[16 rows of warp w][dim] += P_w Y: P [64][64] (row stride ld_p) and Y
// [64][dim] row-major; Y and acc have row stride ld.
MT_SIMT_BODY
template <class M>
MT_HOST_DEVICE void tc_accumulate(float* acc_rows, const typename M::E* P, int ld_p, const typename M::E* Y, int ld,
                                  int dim, int w) {
  for (int j = 0; j < dim; j += 16) {
    typename M::Acc acc;
    M::load_acc(acc, acc_rows + 16 * w * ld + j, ld);
    for (int kk = 0; kk < kTcTile; kk += 16) {
      typename M::TileA p;
      typename M::TileB y;
      M::load_a(p, P + 16 * w * ld_p + kk, ld_p);
      M::load_b(y, Y + kk * ld + j, ld);
      M::mma(acc, p, y);
    }
    M::store_acc(acc_rows + 16 * w * ld + j, acc, ld);
  }
}

// Forward of query tile `tile` of head bh = b·H + h: o and lse.
MT_SIMT_BODY
template <class M, class Blk, class T>
MT_HOST_DEVICE void tc_attention_forward(const Blk& blk, const TcAttention<T>& a, int64_t tile, int64_t bh,
                                         unsigned char* smem) {
  const int Dk = a.Dk, Dv = a.Dv, n = blk.threads;
  const int64_t b = bh / a.H, h = bh % a.H, r0 = tile * kTcTile;
  const TcForwardSmem<typename M::E> s(smem, Dk, Dv);
  const int ldk = s.ld_k, ldv = s.ld_v, ldt = s.ld_t;
  const int64_t q0 = a.query_row(b, 0, h), k0 = a.key_row(b, 0, h);
  tc_stage<M>(blk, s.Q, ldk, a.q, q0, a.H, r0, a.Tq, Dk);
  tc_zero(blk, s.O, ldv, Dv);
  blk.each([&](int tid) {
    if (tid < kTcTile) {
      s.m[tid] = -INFINITY;
      s.l[tid] = 0.0f;
    }
  });
  // Rows past Tq are computed as row Tq - 1 (never stored), so every row sees key 0.
  const int64_t kv_end = a.off + min_i(a.Tq, r0 + kTcTile);  // keys [0, kv_end) are seen by some row
  for (int64_t c0 = 0; c0 < kv_end; c0 += kTcTile) {
    tc_stage<M>(blk, s.K, ldk, a.k, k0, a.H, c0, a.Tk, Dk);
    tc_stage<M>(blk, s.V, ldv, a.v, k0, a.H, c0, a.Tk, Dv);
    blk.each_warp([&](int w) { tc_rows_times_rows<M>(s.S, ldt, s.Q, s.K, ldk, Dk, w); });
    // The online softmax of warp w's rows. Every lane reads m_i before the
    // reductions; lane 0 writes m_i and l_i after them.
    blk.each_warp([&](int w) {
      for (int i = 16 * w; i < 16 * w + 16; ++i) {
        const int64_t t = min_i(r0 + i, a.Tq - 1);
        const int64_t last = a.off + t - c0;  // keys c <= last of this tile are seen
        const float* Si = s.S + i * ldt;
        const float m_old = s.m[i];
        const float mx = blk.warp_max([&](int lane) {
          float x = m_old;
          for (int j = 0; j < kTcLaneCols; ++j) {
            const int c = tc_lane_col(lane, j);
            if (c <= last) x = fmaxf(x, Si[c] * a.scale);
          }
          return x;
        });
        const float alpha = exp_a(m_old - mx);  // 0 on the first tile (m = -inf), mx is finite
        const float sum = blk.warp_sum([&](int lane) {
          float part = 0.0f;
          for (int j = 0; j < kTcLaneCols; ++j) {
            const int c = tc_lane_col(lane, j);
            const float p = c <= last ? exp_a(Si[c] * a.scale - mx) : 0.0f;
            part += p;
            s.P[i * ldt + c] = M::operand(p);
          }
          return part;
        });
        blk.lanes([&](int lane) {
          for (int d = lane; d < Dv; d += 32) s.O[i * ldv + d] *= alpha;
          if (lane == 0) {
            s.l[i] = s.l[i] * alpha + sum;
            s.m[i] = mx;
          }
        });
      }
    });
    blk.each_warp([&](int w) { tc_accumulate<M>(s.O, s.P, ldt, s.V, ldv, Dv, w); });
  }
  blk.each([&](int tid) {
    for (int e = tid; e < kTcTile * Dv; e += n) {
      const TcCell x = tc_cell(e, Dv);
      const int64_t t = r0 + x.row;
      if (t < a.Tq) narrow(a.o[(q0 + t * a.H) * Dv + x.col], s.O[x.row * ldv + x.col] / s.l[x.row]);
    }
    if (tid < kTcTile && r0 + tid < a.Tq) a.lse[bh * a.Tq + r0 + tid] = s.m[tid] + log_a(s.l[tid]);
  });
}

// lse and delta of query rows r0..r0+63 into shared memory (0 past Tq).
MT_SIMT_BODY
template <class Blk, class T>
MT_HOST_DEVICE void tc_stage_row_stats(const Blk& blk, float* lse, float* delta, const TcAttention<T>& a, int64_t bh,
                                       int64_t r0) {
  blk.each([&](int tid) {
    if (tid >= kTcTile) return;
    const int64_t t = r0 + tid;
    lse[tid] = t < a.Tq ? a.lse[bh * a.Tq + t] : 0.0f;
    delta[tid] = t < a.Tq ? a.delta[bh * a.Tq + t] : 0.0f;
  });
}

// dK and dV of key tile `tile` of head bh: loops over the query tiles that see it.
MT_SIMT_BODY
template <class M, class Blk, class T>
MT_HOST_DEVICE void tc_attention_grad_kv(const Blk& blk, const TcAttention<T>& a, int64_t tile, int64_t bh,
                                         unsigned char* smem) {
  const int Dk = a.Dk, Dv = a.Dv, n = blk.threads;
  const int64_t b = bh / a.H, h = bh % a.H, s0 = tile * kTcTile;
  const TcBackwardSmem<typename M::E> s(smem, Dk, Dv, true);
  const int ldk = s.ld_k, ldv = s.ld_v, ldt = s.ld_t;
  const int64_t q0 = a.query_row(b, 0, h), k0 = a.key_row(b, 0, h);
  tc_stage<M>(blk, s.K, ldk, a.k, k0, a.H, s0, a.Tk, Dk);
  tc_stage<M>(blk, s.V, ldv, a.v, k0, a.H, s0, a.Tk, Dv);
  tc_zero(blk, s.dXk, ldk, Dk);
  tc_zero(blk, s.dXv, ldv, Dv);
  // Query t sees key s when t >= s - off: start at the tile holding the first such t.
  for (int64_t r0 = max_i(0, s0 - a.off) / kTcTile * kTcTile; r0 < a.Tq; r0 += kTcTile) {
    tc_stage<M>(blk, s.Q, ldk, a.q, q0, a.H, r0, a.Tq, Dk);
    tc_stage<M>(blk, s.dO, ldv, a.grad_o, q0, a.H, r0, a.Tq, Dv);
    tc_stage_row_stats(blk, s.lse, s.delta, a, bh, r0);
    blk.each_warp([&](int w) {
      tc_rows_times_rows<M>(s.S, ldt, s.K, s.Q, ldk, Dk, w);    // Sᵀ [keys][queries]
      tc_rows_times_rows<M>(s.dP, ldt, s.V, s.dO, ldv, Dv, w);  // dPᵀ
    });
    blk.each([&](int tid) {
      for (int e = tid; e < kTcTile * kTcTile; e += n) {
        const TcCell x = tc_cell(e, kTcTile);  // key s0 + row, query r0 + col
        const int64_t key = s0 + x.row, t = r0 + x.col;
        const int at = x.row * ldt + x.col;
        const bool seen = t < a.Tq && key <= a.off + t;  // implies key < Tk
        const float p = seen ? exp_a(s.S[at] * a.scale - s.lse[x.col]) : 0.0f;
        s.P[at] = M::operand(p);
        s.dS[at] = M::operand(p * (s.dP[at] - s.delta[x.col]));
      }
    });
    blk.each_warp([&](int w) {
      tc_accumulate<M>(s.dXv, s.P, ldt, s.dO, ldv, Dv, w);  // dV += Pᵀ dO
      tc_accumulate<M>(s.dXk, s.dS, ldt, s.Q, ldk, Dk, w);  // dK += dSᵀ Q (times scale below)
    });
  }
  blk.each([&](int tid) {
    for (int e = tid; e < kTcTile * Dk; e += n) {
      const TcCell x = tc_cell(e, Dk);
      const int64_t key = s0 + x.row;
      if (key < a.Tk) narrow(a.grad_k[(k0 + key * a.H) * Dk + x.col], s.dXk[x.row * ldk + x.col] * a.scale);
    }
    for (int e = tid; e < kTcTile * Dv; e += n) {
      const TcCell x = tc_cell(e, Dv);
      const int64_t key = s0 + x.row;
      if (key < a.Tk) narrow(a.grad_v[(k0 + key * a.H) * Dv + x.col], s.dXv[x.row * ldv + x.col]);
    }
  });
}

// dQ of query tile `tile` of head bh.
MT_SIMT_BODY
template <class M, class Blk, class T>
MT_HOST_DEVICE void tc_attention_grad_q(const Blk& blk, const TcAttention<T>& a, int64_t tile, int64_t bh,
                                        unsigned char* smem) {
  const int Dk = a.Dk, Dv = a.Dv, n = blk.threads;
  const int64_t b = bh / a.H, h = bh % a.H, r0 = tile * kTcTile;
  const TcBackwardSmem<typename M::E> s(smem, Dk, Dv, false);
  const int ldk = s.ld_k, ldv = s.ld_v, ldt = s.ld_t;
  const int64_t q0 = a.query_row(b, 0, h), k0 = a.key_row(b, 0, h);
  tc_stage<M>(blk, s.Q, ldk, a.q, q0, a.H, r0, a.Tq, Dk);
  tc_stage<M>(blk, s.dO, ldv, a.grad_o, q0, a.H, r0, a.Tq, Dv);
  tc_stage_row_stats(blk, s.lse, s.delta, a, bh, r0);
  tc_zero(blk, s.dXk, ldk, Dk);
  const int64_t kv_end = a.off + min_i(a.Tq, r0 + kTcTile);
  for (int64_t c0 = 0; c0 < kv_end; c0 += kTcTile) {
    tc_stage<M>(blk, s.K, ldk, a.k, k0, a.H, c0, a.Tk, Dk);
    tc_stage<M>(blk, s.V, ldv, a.v, k0, a.H, c0, a.Tk, Dv);
    blk.each_warp([&](int w) {
      tc_rows_times_rows<M>(s.S, ldt, s.Q, s.K, ldk, Dk, w);
      tc_rows_times_rows<M>(s.dP, ldt, s.dO, s.V, ldv, Dv, w);
    });
    blk.each([&](int tid) {
      for (int e = tid; e < kTcTile * kTcTile; e += n) {
        const TcCell x = tc_cell(e, kTcTile);  // query r0 + row, key c0 + col
        const int64_t t = r0 + x.row;
        const int at = x.row * ldt + x.col;
        const bool seen = t < a.Tq && c0 + x.col <= a.off + t;
        const float p = seen ? exp_a(s.S[at] * a.scale - s.lse[x.row]) : 0.0f;
        s.dS[at] = M::operand(p * (s.dP[at] - s.delta[x.row]));
      }
    });
    blk.each_warp([&](int w) { tc_accumulate<M>(s.dXk, s.dS, ldt, s.K, ldk, Dk, w); });  // dQ += dS K
  }
  blk.each([&](int tid) {
    for (int e = tid; e < kTcTile * Dk; e += n) {
      const TcCell x = tc_cell(e, Dk);
      const int64_t t = r0 + x.row;
      if (t < a.Tq) narrow(a.grad_q[(q0 + t * a.H) * Dk + x.col], s.dXk[x.row * ldk + x.col] * a.scale);
    }
  });
}

}  // namespace moetrain::simt
