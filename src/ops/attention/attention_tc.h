// Causal attention on tensor cores, for bf16 (FlashAttention-2's tiling): the
// bodies of the kernels in attention_tc_cuda.cu, written once for the GPU and
// the host (ops/common/simt.h; the tile seam, HostMma and DeviceMma, is
// ops/common/tc_mma.h). Scores, probabilities and gradients are products of
// 16x16x16 tiles: bf16 operands, f32 accumulation (ldmatrix and mma.sync on
// the GPU, HostMma on the host: the same lane maps fed to a model of those
// instructions, the same operands rounded to bf16 the same way, summed in f32),
// so tests/ops/attention/attention_tc_test.cpp runs these very bodies on the CPU
// against the CPU attention kernels. Operands are staged into shared memory by
// 16-byte asynchronous copies (cp.async; element by element where a tensor is
// not 16-byte aligned).
//
// A block of 4 warps takes a tile of 64 query rows (forward, dQ) or 64 keys
// (dK/dV); warp w owns rows (keys) 16w..16w+15 of it. Per tile of the other
// side, in phases:
//   forward: S = Q Kᵀ (warps) -> online softmax of warp w's 16 rows at once,
//            two lanes a row: P in bf16 and the rows' factors alpha ->
//            O (rows times alpha) += P V (warps)
//   dK, dV:  Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (warps) -> Pᵀ = e^{scale Sᵀ - lse},
//            dSᵀ = Pᵀ (dPᵀ - delta) in bf16 (every thread, elementwise) ->
//            dV += Pᵀ dO, dK += dSᵀ Q (warps)
//   dQ:      S = Q Kᵀ, dP = dO Vᵀ -> dS -> dQ += dS K
// Shared rows are padded (kTcPad) and a warp's lanes walk rows along their
// columns, so no phase has bank conflicts in the model of tests/ops/smem_banks.h
// (docs/cuda.md, "Attention on tensor cores").
// Accumulators (O, dK, dV, dQ) live in one of two places (TcAccumulators):
//   registers: a body instantiated for its head dims (DK, DV template
//     arguments, the pairs of tc_register_dims) keeps warp w's 16 rows of each
//     accumulator in mma accumulator registers across the whole loop
//     (Blk::PerWarp, simt.h), indexed only in unrolled loops. The forward's
//     online softmax rescales O's rows in the registers (M::scale_rows: each
//     register's row is tc_acc_cell's, PTX's documented layout). At the end each warp stores its
//     fragments through its own rows of S (free by then) and its lanes write
//     them to global memory.
//   shared: every other shape (DK = DV = 0): f32 arrays in shared memory that
//     each tile loads, adds to and stores back.
// Both do the same f32 operations in the same order (a product added to the
// rescaled O, O / l, dK·scale), so the host runs of the two agree bit for bit;
// every sum runs in a fixed order, so a run repeats itself bit for bit. delta =
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
#include "ops/common/tc_mma.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace moetrain::simt {

inline constexpr int kTcTile = 64;  // query rows and keys per tile
inline constexpr int kTcWarps = 4;  // warp w owns rows 16w..16w+15 of a tile
inline constexpr int kTcThreads = 32 * kTcWarps;
inline constexpr int kTcMaxDim = 256;
// Shapes, inputs and outputs of one attention call; T is the bf16 storage type.
template <class T>
struct TcAttention {
  int64_t B = 0, Tq = 0, Tk = 0, off = 0, H = 0;
  int Dk = 0, Dv = 0;
  float scale = 1;
  const T *q = nullptr, *k = nullptr, *v = nullptr, *grad_o = nullptr;
  T *o = nullptr, *grad_q = nullptr, *grad_k = nullptr, *grad_v = nullptr;
  float* lse = nullptr;           // [B, H, Tq]: written by the forward, read by the backward
  float* row_max = nullptr;       // [B, H, Tq] or null: the forward's row max of scale·q·k (QK-Clip)
  const float* delta = nullptr;   // [B, H, Tq]: rowsum(dO ⊙ O), backward

  // Element (b, t, h, 0) of q/o (queries) or k/v (keys), in rows of the head dim.
  MT_HOST_DEVICE int64_t query_row(int64_t b, int64_t t, int64_t h) const { return (b * Tq + t) * H + h; }
  MT_HOST_DEVICE int64_t key_row(int64_t b, int64_t s, int64_t h) const { return (b * Tk + s) * H + h; }
};

// Where a body keeps its accumulators (the header comment above).
enum class TcAccumulators { shared, registers };

// Row strides (elements) of the shared arrays: ld_k for rows of Dk (Q, K, dQ,
// dK), ld_v for rows of Dv (V, dO, O, dV), ld_t for rows of a tile (S, P, dP,
// dS).
struct TcStrides {
  int ld_k, ld_v, ld_t;
  MT_HOST_DEVICE TcStrides(int Dk, int Dv, int pad) : ld_k(Dk + pad), ld_v(Dv + pad), ld_t(kTcTile + pad) {}
};

// O: the shared accumulator (shared path only). Per row of the tile: m and l,
// the online softmax's max and sum; mx, the max over this key tile too;
// alpha, the factor e^{m - mx} that rescales O's row before P V is added.
template <class E>
struct TcForwardSmem : TcStrides {
  E *Q, *K, *V, *P;
  float *S, *O, *alpha, *mx, *m, *l;
  size_t bytes;
  MT_HOST_DEVICE TcForwardSmem(unsigned char* base, int Dk, int Dv, TcAccumulators acc, int pad = kTcPad)
      : TcStrides(Dk, Dv, pad) {
    const bool shared = acc == TcAccumulators::shared;
    Carver c{base};
    Q = c.take<E>(kTcTile * ld_k);
    K = c.take<E>(kTcTile * ld_k);
    V = c.take<E>(kTcTile * ld_v);
    P = c.take<E>(kTcTile * ld_t);
    S = c.take<float>(kTcTile * ld_t);
    O = shared ? c.take<float>(kTcTile * ld_v) : nullptr;
    alpha = c.take<float>(kTcTile);
    mx = c.take<float>(kTcTile);
    m = c.take<float>(kTcTile);
    l = c.take<float>(kTcTile);
    bytes = c.used;
  }
};

// The backward kernels' arrays; dX is the accumulated gradient (dK and dV for
// the key-tile kernel, dQ in dX_k for the query-tile kernel), in shared memory
// on the shared path only.
template <class E>
struct TcBackwardSmem : TcStrides {
  E *Q, *K, *V, *dO, *P, *dS;
  float *S, *dP, *dXk, *dXv, *lse, *delta;
  size_t bytes;
  MT_HOST_DEVICE TcBackwardSmem(unsigned char* base, int Dk, int Dv, bool key_tile, TcAccumulators acc,
                                int pad = kTcPad)
      : TcStrides(Dk, Dv, pad) {
    const bool shared = acc == TcAccumulators::shared;
    Carver c{base};
    Q = c.take<E>(kTcTile * ld_k);
    K = c.take<E>(kTcTile * ld_k);
    V = c.take<E>(kTcTile * ld_v);
    dO = c.take<E>(kTcTile * ld_v);
    P = key_tile ? c.take<E>(kTcTile * ld_t) : nullptr;
    dS = c.take<E>(kTcTile * ld_t);
    S = c.take<float>(kTcTile * ld_t);
    dP = c.take<float>(kTcTile * ld_t);
    dXk = shared ? c.take<float>(kTcTile * ld_k) : nullptr;
    dXv = shared && key_tile ? c.take<float>(kTcTile * ld_v) : nullptr;
    lse = c.take<float>(kTcTile);
    delta = c.take<float>(kTcTile);
    bytes = c.used;
  }
};

// The head dims whose kernels keep their accumulators in registers: the
// attention heads of configs/*.yaml (GPT-2 Shakespeare 32, k3-tiny's and
// k3-shakespeare's MLA 48/32, GPT-2 64, k3-small's MLA 96/64, K3's MLA
// 192/128) and 128/128 (no config of ours yet, the common large head).
// f(TcDims<Dk, Dv>{}) for such a pair, then true; false for others.
template <int DK, int DV>
struct TcDims {
  static constexpr int Dk = DK, Dv = DV;
};
template <class F>
bool tc_register_dims(int Dk, int Dv, F&& f) {
  if (Dk == 32 && Dv == 32) return f(TcDims<32, 32>{}), true;
  if (Dk == 48 && Dv == 32) return f(TcDims<48, 32>{}), true;
  if (Dk == 64 && Dv == 64) return f(TcDims<64, 64>{}), true;
  if (Dk == 96 && Dv == 64) return f(TcDims<96, 64>{}), true;
  if (Dk == 128 && Dv == 128) return f(TcDims<128, 128>{}), true;
  if (Dk == 192 && Dv == 128) return f(TcDims<192, 128>{}), true;
  return false;
}

// The row phases use every thread of the block, and a warp's lanes touch
// consecutive elements of a row (docs/cuda.md, "Attention on tensor cores"):
//   elementwise phases (zeroing, P and dS in the backward, the stores):
//     thread tid takes elements e = tid, tid + threads, ... of a [kTcTile][dim]
//     tile, cell tc_cell(e, dim);
//   staging: thread tid takes 8-element chunks e = tid, tid + threads, ... of
//     a [kTcTile][dim] tile, cell tc_chunk(e, dim) (one 16-byte copy each);
//   the forward's softmax: warp w's 16 rows at once, kTcRowLanes = 2 lanes a
//     row: lane l on row l / 2 of the warp's, its j-th column (j < kTcLaneCols)
//     tc_softmax_cell(l, j).col; a row's max and sum are
//     group_max/group_sum<2> (simt.h: one shuffle).
// (TcCell, tc_cell, tc_chunk and tc_aligned16 are in ops/common/tc_mma.h.)
inline constexpr int kTcRowLanes = 2;
inline constexpr int kTcLaneCols = kTcTile / kTcRowLanes;
// The two lanes of row r take the even and odd columns, starting r pairs to the
// right (rotated): 32 lanes on 32 banks of S (f32, 72 floats a row: bank 10r +
// 2j + half) and of P (bf16: bank 5r + j, the pair sharing a word).
MT_HOST_DEVICE inline TcCell tc_softmax_cell(int lane, int j) {
  const int r = lane / kTcRowLanes;
  return {r, kTcRowLanes * ((j + r) % kTcLaneCols) + lane % kTcRowLanes};
}

// Rows first..first+63 of a [.., H, dim] tensor (row index of (b, t, h) =
// row0 + t·H; rows >= limit read as 0) into dst as operands, row stride ld:
// 16-byte asynchronous copies (M::copy8, cp.async on the GPU) where src is
// 16-byte aligned, element by element otherwise (a view at an odd offset).
MT_SIMT_BODY
template <class M, class Blk, class T>
MT_HOST_DEVICE void tc_stage(const Blk& blk, typename M::E* dst, int ld, const T* src, int64_t row0, int64_t H,
                             int64_t first, int64_t limit, int dim) {
  const int n = blk.threads;
  if (tc_aligned16(src)) {
    blk.each([&](int tid) {
      for (int e = tid; e < kTcTile * dim / kTcChunk; e += n) {
        const TcCell x = tc_chunk(e, dim);
        const int64_t t = first + x.row;
        if (t < limit)
          M::copy8(dst + x.row * ld + x.col, src + (row0 + t * H) * dim + x.col);
        else
          M::zero8(dst + x.row * ld + x.col);
      }
      M::copy_wait();
    });
    return;
  }
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
// [64][dim] row-major; Y and acc have row stride ld. row_scale (if not null):
// acc's row i is first multiplied by row_scale[i] ([64], the forward's alpha).
MT_SIMT_BODY
template <class M>
MT_HOST_DEVICE void tc_accumulate(float* acc_rows, const typename M::E* P, int ld_p, const typename M::E* Y, int ld,
                                  int dim, int w, const float* row_scale = nullptr) {
  for (int j = 0; j < dim; j += 16) {
    typename M::Acc acc;
    M::load_acc(acc, acc_rows + 16 * w * ld + j, ld);
    if (row_scale) M::scale_rows(acc, row_scale + 16 * w);
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

// The register path's tc_accumulate: acc.f[j] += P_w Y[:, 16j..16j+15] for
// warp w. Each fragment sees the products in kk order, as in tc_accumulate.
MT_SIMT_BODY
template <class M, int N>
MT_HOST_DEVICE void tc_accumulate_frags(TcFrags<M, N>& acc, const typename M::E* P, int ld_p,
                                        const typename M::E* Y, int ld, int w) {
MT_UNROLL
  for (int kk = 0; kk < kTcTile; kk += 16) {
    typename M::TileA p;
    M::load_a(p, P + 16 * w * ld_p + kk, ld_p);
MT_UNROLL
    for (int j = 0; j < N; ++j) {
      typename M::TileB y;
      M::load_b(y, Y + kk * ld + 16 * j, ld);
      M::mma(acc.f[j], p, y);
    }
  }
}

// Forward of query tile `tile` of head bh = b·H + h: o and lse. DK, DV > 0:
// the register path for those head dims; 0: the shared path (a.Dk, a.Dv).
MT_SIMT_BODY
template <class M, int DK = 0, int DV = 0, class Blk, class T>
MT_HOST_DEVICE void tc_attention_forward(const Blk& blk, const TcAttention<T>& a, int64_t tile, int64_t bh,
                                         unsigned char* smem) {
  constexpr bool kRegs = DV > 0;
  const int Dk = kRegs ? DK : a.Dk, Dv = kRegs ? DV : a.Dv, n = blk.threads;
  const int64_t b = bh / a.H, h = bh % a.H, r0 = tile * kTcTile;
  const TcForwardSmem<typename M::E> s(smem, Dk, Dv, kRegs ? TcAccumulators::registers : TcAccumulators::shared);
  const int ldk = s.ld_k, ldv = s.ld_v, ldt = s.ld_t;
  const int64_t q0 = a.query_row(b, 0, h), k0 = a.key_row(b, 0, h);
  typename Blk::template PerWarp<TcFrags<M, DV / 16>> o_acc(blk);  // O: warp w's 16 rows
  tc_stage<M>(blk, s.Q, ldk, a.q, q0, a.H, r0, a.Tq, Dk);
  if constexpr (kRegs)
    blk.each_warp([&](int w) { tc_zero_frags(o_acc.at(w)); });
  else
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
    // The online softmax of warp w's 16 rows, two lanes a row (tc_softmax_cell):
    // the rows' maxima (mx), then P = e^{scale S - mx} and the rows' sums; the
    // first lane of a row writes what the next call reads (mx), then alpha,
    // l and m.
    blk.each_warp([&](int w) {
      auto row_of = [&](int lane) { return 16 * w + lane / kTcRowLanes; };
      auto last_of = [&](int i) {  // keys c <= last of this tile are seen by row i
        return a.off + min_i(r0 + i, a.Tq - 1) - c0;
      };
      blk.template group_max<kTcRowLanes>(
          [&](int lane) {
            const int i = row_of(lane);
            const int64_t last = last_of(i);
            float x = s.m[i];
            for (int j = 0; j < kTcLaneCols; ++j) {
              const int c = tc_softmax_cell(lane, j).col;
              if (c <= last) x = fmaxf(x, s.S[i * ldt + c] * a.scale);
            }
            return x;
          },
          [&](int lane, float mx) {
            if (lane % kTcRowLanes == 0) s.mx[row_of(lane)] = mx;
          });
      blk.template group_sum<kTcRowLanes>(
          [&](int lane) {
            const int i = row_of(lane);
            const int64_t last = last_of(i);
            const float mx = s.mx[i];
            float part = 0.0f;
            for (int j = 0; j < kTcLaneCols; ++j) {
              const int c = tc_softmax_cell(lane, j).col;
              const float p = c <= last ? exp_a(s.S[i * ldt + c] * a.scale - mx) : 0.0f;
              part += p;
              s.P[i * ldt + c] = M::operand(p);
            }
            return part;
          },
          [&](int lane, float sum) {
            const int i = row_of(lane);
            if (lane % kTcRowLanes != 0) return;
            const float alpha = exp_a(s.m[i] - s.mx[i]);  // 0 on the first tile (m = -inf), mx is finite
            s.alpha[i] = alpha;
            s.l[i] = s.l[i] * alpha + sum;
            s.m[i] = s.mx[i];
          });
    });
    blk.each_warp([&](int w) {
      if constexpr (kRegs) {
        auto& o = o_acc.at(w);
MT_UNROLL
        for (int j = 0; j < DV / 16; ++j) M::scale_rows(o.f[j], s.alpha + 16 * w);
        tc_accumulate_frags(o, s.P, ldt, s.V, ldv, w);
      } else {
        tc_accumulate<M>(s.O, s.P, ldt, s.V, ldv, Dv, w, s.alpha);
      }
    });
  }
  if constexpr (kRegs) {
    // S is free: its last readers (the softmax) ran before the last barrier.
    blk.each_warp([&](int w) {
      tc_store_frags<M>(blk, o_acc.at(w), s.S + 16 * w * ldt, ldt, [&](int r, int c, float x) {
        const int64_t t = r0 + 16 * w + r;
        if (t < a.Tq) narrow(a.o[(q0 + t * a.H) * Dv + c], x / s.l[16 * w + r]);
      });
      blk.lanes([&](int lane) {
        const int i = 16 * w + lane;
        if (lane < 16 && r0 + i < a.Tq) {
          a.lse[bh * a.Tq + r0 + i] = s.m[i] + log_a(s.l[i]);
          if (a.row_max) a.row_max[bh * a.Tq + r0 + i] = s.m[i];
        }
      });
    });
  } else {
    blk.each([&](int tid) {
      for (int e = tid; e < kTcTile * Dv; e += n) {
        const TcCell x = tc_cell(e, Dv);
        const int64_t t = r0 + x.row;
        if (t < a.Tq) narrow(a.o[(q0 + t * a.H) * Dv + x.col], s.O[x.row * ldv + x.col] / s.l[x.row]);
      }
      if (tid < kTcTile && r0 + tid < a.Tq) {
        a.lse[bh * a.Tq + r0 + tid] = s.m[tid] + log_a(s.l[tid]);
        if (a.row_max) a.row_max[bh * a.Tq + r0 + tid] = s.m[tid];
      }
    });
  }
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

// dK and dV of key tile `tile` of head bh: loops over the query tiles that see
// it. DK, DV as in tc_attention_forward.
MT_SIMT_BODY
template <class M, int DK = 0, int DV = 0, class Blk, class T>
MT_HOST_DEVICE void tc_attention_grad_kv(const Blk& blk, const TcAttention<T>& a, int64_t tile, int64_t bh,
                                         unsigned char* smem) {
  constexpr bool kRegs = DV > 0;
  const int Dk = kRegs ? DK : a.Dk, Dv = kRegs ? DV : a.Dv, n = blk.threads;
  const int64_t b = bh / a.H, h = bh % a.H, s0 = tile * kTcTile;
  const TcBackwardSmem<typename M::E> s(smem, Dk, Dv, true,
                                        kRegs ? TcAccumulators::registers : TcAccumulators::shared);
  const int ldk = s.ld_k, ldv = s.ld_v, ldt = s.ld_t;
  const int64_t q0 = a.query_row(b, 0, h), k0 = a.key_row(b, 0, h);
  typename Blk::template PerWarp<TcFrags<M, DK / 16>> dk_acc(blk);  // warp w's 16 keys
  typename Blk::template PerWarp<TcFrags<M, DV / 16>> dv_acc(blk);
  tc_stage<M>(blk, s.K, ldk, a.k, k0, a.H, s0, a.Tk, Dk);
  tc_stage<M>(blk, s.V, ldv, a.v, k0, a.H, s0, a.Tk, Dv);
  if constexpr (kRegs) {
    blk.each_warp([&](int w) {
      tc_zero_frags(dk_acc.at(w));
      tc_zero_frags(dv_acc.at(w));
    });
  } else {
    tc_zero(blk, s.dXk, ldk, Dk);
    tc_zero(blk, s.dXv, ldv, Dv);
  }
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
      if constexpr (kRegs) {
        tc_accumulate_frags(dv_acc.at(w), s.P, ldt, s.dO, ldv, w);  // dV += Pᵀ dO
        tc_accumulate_frags(dk_acc.at(w), s.dS, ldt, s.Q, ldk, w);  // dK += dSᵀ Q (times scale below)
      } else {
        tc_accumulate<M>(s.dXv, s.P, ldt, s.dO, ldv, Dv, w);  // dV += Pᵀ dO
        tc_accumulate<M>(s.dXk, s.dS, ldt, s.Q, ldk, Dk, w);  // dK += dSᵀ Q (times scale below)
      }
    });
  }
  if constexpr (kRegs) {
    // S is free: the elementwise phase, its last reader, ran before the last barrier.
    blk.each_warp([&](int w) {
      float* scratch = s.S + 16 * w * ldt;
      tc_store_frags<M>(blk, dk_acc.at(w), scratch, ldt, [&](int r, int c, float x) {
        const int64_t key = s0 + 16 * w + r;
        if (key < a.Tk) narrow(a.grad_k[(k0 + key * a.H) * Dk + c], x * a.scale);
      });
      tc_store_frags<M>(blk, dv_acc.at(w), scratch, ldt, [&](int r, int c, float x) {
        const int64_t key = s0 + 16 * w + r;
        if (key < a.Tk) narrow(a.grad_v[(k0 + key * a.H) * Dv + c], x);
      });
    });
    return;
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

// dQ of query tile `tile` of head bh; DK, DV as in tc_attention_forward.
MT_SIMT_BODY
template <class M, int DK = 0, int DV = 0, class Blk, class T>
MT_HOST_DEVICE void tc_attention_grad_q(const Blk& blk, const TcAttention<T>& a, int64_t tile, int64_t bh,
                                        unsigned char* smem) {
  constexpr bool kRegs = DV > 0;
  const int Dk = kRegs ? DK : a.Dk, Dv = kRegs ? DV : a.Dv, n = blk.threads;
  const int64_t b = bh / a.H, h = bh % a.H, r0 = tile * kTcTile;
  const TcBackwardSmem<typename M::E> s(smem, Dk, Dv, false,
                                        kRegs ? TcAccumulators::registers : TcAccumulators::shared);
  const int ldk = s.ld_k, ldv = s.ld_v, ldt = s.ld_t;
  const int64_t q0 = a.query_row(b, 0, h), k0 = a.key_row(b, 0, h);
  typename Blk::template PerWarp<TcFrags<M, DK / 16>> dq_acc(blk);  // warp w's 16 rows
  tc_stage<M>(blk, s.Q, ldk, a.q, q0, a.H, r0, a.Tq, Dk);
  tc_stage<M>(blk, s.dO, ldv, a.grad_o, q0, a.H, r0, a.Tq, Dv);
  tc_stage_row_stats(blk, s.lse, s.delta, a, bh, r0);
  if constexpr (kRegs)
    blk.each_warp([&](int w) { tc_zero_frags(dq_acc.at(w)); });
  else
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
    blk.each_warp([&](int w) {  // dQ += dS K
      if constexpr (kRegs)
        tc_accumulate_frags(dq_acc.at(w), s.dS, ldt, s.K, ldk, w);
      else
        tc_accumulate<M>(s.dXk, s.dS, ldt, s.K, ldk, Dk, w);
    });
  }
  if constexpr (kRegs) {
    // S is free: the elementwise phase, its last reader, ran before the last barrier.
    blk.each_warp([&](int w) {
      tc_store_frags<M>(blk, dq_acc.at(w), s.S + 16 * w * ldt, ldt, [&](int r, int c, float x) {
        const int64_t t = r0 + 16 * w + r;
        if (t < a.Tq) narrow(a.grad_q[(q0 + t * a.H) * Dk + c], x * a.scale);
      });
    });
    return;
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
