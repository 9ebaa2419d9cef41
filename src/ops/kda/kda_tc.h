// The chunked KDA's state products on tensor cores (TF32 operands, f32
// accumulation): bodies of kernels in kda_cuda.cu that replace the scalar
// kda_chunk_scan, kda_chunk_output and kda_chunk_backward_scan of kda_simt.h
// when cuda::set_kda_tensor_cores(true) (the trainer's choice for bf16 runs and
// train.tf32) and the shape allows (K, V and C multiples of 16). Written once for
// the GPU and the host (ops/common/simt.h): TF32 tiles of 16x16x8 (ops/common/tf32_tiles.h)
// are wmma on the GPU and HostTf32 on the host (the same operands rounded to
// TF32 the same way, products and sums in f32), so tests/ops/kda/kda_simt_test.cpp
// runs these very bodies on the CPU against the scalar bodies and the CPU kernels.
//
// Why these three: they hold the chunked form's state products, about three
// quarters of its FLOPs at K = V = 128, C = 64 (per chunk and value head:
// V^new = U - W S_n and S_{n+1} = Diag(e^{γ_C}) S_n + (K ⊙ e^{γ_C-γ})^T V^new in
// the scan, O = (Q̄ ⊙ e^γ) S_n + A^qk V^new, and the backward scan's
// dV^new = A^qkᵀ dO + (K ⊙ e^{γ_C-γ}) dS, dS_n = Diag(e^{γ_C}) dS + (Q̄ ⊙ e^γ)ᵀ dO
// - Wᵀ dV^new); kda_chunk_grad (kda_simt.h) takes the same tiles for its five
// C x K x V products (V^new, dW, dK̂, dO S_nᵀ). The scans keep a [K, BV] tile of
// S (of dS) in f32 shared memory through all chunks: the state accumulates in
// f32 (docs/model.md#mixed-precision); only the operands of each product are rounded to TF32
// (fla rounds them to bf16).
// A block is 4 warps; warp w takes the 16x16 output tiles w, w + 4, ... of a
// product; thread phases stage, scale and write back. Every sum runs in a fixed
// order: a run repeats itself bit for bit.
#pragma once

#include <cstdint>

#include "ops/kda/kda_simt.h"
#include "ops/common/simt.h"
#include "ops/common/tf32_tiles.h"

namespace moetrain::simt {

inline constexpr int kKdaTcWarps = 4;
inline constexpr int kKdaTcThreads = 32 * kKdaTcWarps;

// Whether the tensor-core bodies take a shape: K, V and C multiples of 16.
inline bool kda_tc_shape_ok(int64_t K, int64_t V, int64_t C) { return K % 16 == 0 && V % 16 == 0 && C % 16 == 0; }
// The column tile of the chunked scans (kda_chunk_scan / kda_chunk_backward_scan
// of kda_simt.h, or kda_chunk_scan_tc / kda_chunk_backward_scan_tc below): the
// columns of S one scan block takes. A scan block runs its columns through every
// chunk in order, so the grid, tasks x ceil(V / columns) blocks, is all the
// parallelism the scan has (docs/cuda.md#kda-and-linear-attention). The tiles a
// path takes: the scalar bodies any of 64, 32, 16, 8 (a thread per column: the
// block is the tile; never wider than V rounded up to 8, so at most 7 threads of a
// lone tile idle), the tensor-core bodies 32 or 16 dividing V (16x16 output tiles).
// Every column is computed alone, in the same order whatever the tile: the tile
// changes no bit of the result (tested in tests/ops/kda/kda_simt_test.cpp).
enum class KdaScanPath { scalar, tensor_cores };

inline constexpr int64_t kKdaScanTiles[] = {64, 32, 16, 8};  // widest first

// Whether `path` takes a tile of `columns` for value width V.
inline bool kda_scan_tile_ok(KdaScanPath path, int64_t V, int64_t columns) {
  if (path == KdaScanPath::tensor_cores) return (columns == 16 || columns == 32) && V % columns == 0;
  return (columns == 8 || columns == 16 || columns == 32 || columns == 64) && columns <= (V + 7) / 8 * 8;
}

// Scan blocks of a tile: tasks x ceil(V / columns).
inline int64_t kda_scan_blocks(int64_t tasks, int64_t V, int64_t columns) {
  return tasks * ((V + columns - 1) / columns);
}

// The tile for `tasks` = B x HV scans of value width V on a device of `sms`
// multiprocessors: `wanted` where the path takes it (cuda::set_kda_scan_columns,
// for experiments); else the widest tile the path takes that gives at least two
// blocks per multiprocessor, else (too few columns for that) the narrowest, the
// most blocks the shape has. Wider tiles where they suffice: fewer blocks reload
// the chunk's W, K̂ (and, backward, A^qk, Q̂) per column. The tensor-core path
// needs V a multiple of 16 (kda_tc_shape_ok); a scalar shape any V >= 1.
inline int64_t kda_scan_columns(int64_t tasks, int64_t V, int64_t sms, KdaScanPath path, int64_t wanted = 0) {
  if (wanted > 0 && kda_scan_tile_ok(path, V, wanted)) return wanted;
  int64_t narrowest = 0;
  for (int64_t columns : kKdaScanTiles) {
    if (!kda_scan_tile_ok(path, V, columns)) continue;
    if (kda_scan_blocks(tasks, V, columns) >= 2 * sms) return columns;
    narrowest = columns;
  }
  return narrowest > 0 ? narrowest : 8;  // V = 0 (scalar): no columns, any tile
}

// f32 elements of `sh` for the bodies below.
inline int64_t kda_tc_scan_shared_elements(int64_t K, int64_t C, int64_t BV) { return (K + C) * BV; }
inline int64_t kda_tc_backward_scan_shared_elements(int64_t K, int64_t C, int64_t BV) { return (K + 2 * C) * BV; }
inline int64_t kda_tc_output_shared_elements(int64_t C, int64_t V) { return C * V; }

// Column tile [column0, column0 + BV) of task `task` through every chunk: V^new
// and S_n as kda_chunk_scan writes them (every row of V^new, those past a short
// last chunk 0), S_T into the state.
MT_SIMT_BODY
template <class M, class Block, class T>
MT_HOST_DEVICE void kda_chunk_scan_tc(const Block& blk, const KdaChunkArgs<T, float>& a, int64_t task,
                                      int64_t column0, int64_t BV, float* sh) {
  const int threads = blk.threads;
  const int64_t K = a.K, V = a.V, C = a.C, KV = K * V;
  float *S = sh, *Vn = sh + K * BV;  // S [K][BV], V^new [C][BV]
  T* state = a.state + task * KV + column0;
  blk.each([&](int tid) {
    for (int64_t e = tid; e < K * BV; e += threads) S[e] = static_cast<float>(state[e / BV * V + e % BV]);
  });
  for (int64_t n = 0; n < a.chunks(); ++n) {
    const float *W = a.W + a.at(task, n, C * K), *Kd = a.Kd + a.at(task, n, C * K);
    const float *U = a.U + a.at(task, n, C * V) + column0, *decay = a.decay + a.at(task, n, K);
    float *Sn = a.states + a.at(task, n, KV) + column0, *Vnew = a.Vnew + a.at(task, n, C * V) + column0;
    blk.each([&](int tid) {
      for (int64_t e = tid; e < K * BV; e += threads) Sn[e / BV * V + e % BV] = S[e];
    });
    // V^new = U - W S_n.
    blk.each_warp([&](int w) {
      warp_tiles(w, kKdaTcWarps, C, BV, [&](int64_t r, int64_t c) {
        typename M::Acc acc;
        M::load_acc(acc, U + r * V + c, V);
        tile_mma<M>(acc, W + r * K, K, S + c, BV, 0, K, true);
        M::store_acc(Vn + r * BV + c, acc, BV);
      });
    });
    blk.each([&](int tid) {
      for (int64_t e = tid; e < C * BV; e += threads) Vnew[e / BV * V + e % BV] = Vn[e];
      for (int64_t e = tid; e < K * BV; e += threads) S[e] *= decay[e / BV];
    });
    // S_{n+1} = Diag(e^{γ_C}) S_n + (K ⊙ e^{γ_C-γ})ᵀ V^new.
    blk.each_warp([&](int w) {
      warp_tiles(w, kKdaTcWarps, K, BV, [&](int64_t r, int64_t c) {
        typename M::Acc acc;
        M::load_acc(acc, S + r * BV + c, BV);
        tile_mma<M, true>(acc, Kd + r, K, Vn + c, BV, 0, C);
        M::store_acc(S + r * BV + c, acc, BV);
      });
    });
  }
  blk.each([&](int tid) {
    for (int64_t e = tid; e < K * BV; e += threads) state[e / BV * V + e % BV] = T(S[e]);
  });
}

// O of chunk n of task `task` = (Q̄ ⊙ e^γ) S_n + A^qk V^new (A^qk lower triangular:
// row tile r needs V^new rows < r + 16 only).
MT_SIMT_BODY
template <class M, class Block, class T>
MT_HOST_DEVICE void kda_chunk_output_tc(const Block& blk, const KdaChunkArgs<T, float>& a, int64_t task, int64_t n,
                                        float* sh) {
  const int threads = blk.threads;
  const int64_t K = a.K, V = a.V, C = a.C, b = task / a.HV, hv = task % a.HV, rows = a.rows(n);
  const float *Sn = a.states + a.at(task, n, K * V), *Qd = a.Qd + a.at(task, n, C * K);
  const float *Aqk = a.Aqk + a.at(task, n, C * C), *Vnew = a.Vnew + a.at(task, n, C * V);
  float* O = sh;  // [C][V]
  blk.each_warp([&](int w) {
    warp_tiles(w, kKdaTcWarps, C, V, [&](int64_t r, int64_t c) {
      typename M::Acc acc;
      M::zero(acc);
      tile_mma<M>(acc, Qd + r * K, K, Sn + c, V, 0, K);
      tile_mma<M>(acc, Aqk + r * C, C, Vnew + c, V, 0, r + 16);
      M::store_acc(O + r * V + c, acc, V);
    });
  });
  blk.each([&](int tid) {
    for (int64_t e = tid; e < rows * V; e += threads)
      a.o[((b * a.Tn + n * C + e / V) * a.HV + hv) * V + e % V] = T(O[e]);
  });
}

// The backward's reverse scan over chunks for column tile [column0, column0 + BV)
// of task `task`, as kda_chunk_backward_scan: dS_exit and dV^new of every chunk
// (rows past a short last chunk 0), dS_0 into grad_state0.
MT_SIMT_BODY
template <class M, class Block, class T>
MT_HOST_DEVICE void kda_chunk_backward_scan_tc(const Block& blk, const KdaChunkArgs<T, float>& a, int64_t task,
                                               int64_t column0, int64_t BV, float* sh) {
  const int threads = blk.threads;
  const int64_t K = a.K, V = a.V, C = a.C, KV = K * V, b = task / a.HV, hv = task % a.HV;
  float *dS = sh, *dO = sh + K * BV, *dV = dO + C * BV;  // dS [K][BV]; dO, -dV^new [C][BV]
  blk.each([&](int tid) {
    for (int64_t e = tid; e < K * BV; e += threads)
      dS[e] = static_cast<float>(a.grad_state[task * KV + e / BV * V + column0 + e % BV]);
  });
  for (int64_t n = a.chunks() - 1; n >= 0; --n) {
    const int64_t rows = a.rows(n);
    const float *Aqk = a.Aqk + a.at(task, n, C * C), *Kd = a.Kd + a.at(task, n, C * K);
    const float *Qd = a.Qd + a.at(task, n, C * K), *W = a.W + a.at(task, n, C * K), *decay = a.decay + a.at(task, n, K);
    float *dS_exit = a.dS_exit + a.at(task, n, KV) + column0, *dVnew = a.dVnew + a.at(task, n, C * V) + column0;
    blk.each([&](int tid) {
      for (int64_t e = tid; e < K * BV; e += threads) dS_exit[e / BV * V + e % BV] = dS[e];
      for (int64_t e = tid; e < C * BV; e += threads) {
        const int64_t i = e / BV;
        dO[e] = i < rows ? static_cast<float>(a.grad_o[((b * a.Tn + n * C + i) * a.HV + hv) * V + column0 + e % BV])
                         : 0.0f;
      }
    });
    // dV^new = A^qkᵀ dO + (K ⊙ e^{γ_C-γ}) dS (A^qkᵀ upper triangular: row tile r needs dO rows >= r).
    blk.each_warp([&](int w) {
      warp_tiles(w, kKdaTcWarps, C, BV, [&](int64_t r, int64_t c) {
        typename M::Acc acc;
        M::zero(acc);
        tile_mma<M, true>(acc, Aqk + r, C, dO + c, BV, r, C);
        tile_mma<M>(acc, Kd + r * K, K, dS + c, BV, 0, K);
        M::store_acc(dV + r * BV + c, acc, BV);
      });
    });
    blk.each([&](int tid) {
      for (int64_t e = tid; e < C * BV; e += threads) {
        dVnew[e / BV * V + e % BV] = dV[e];
        dV[e] = -dV[e];
      }
      for (int64_t e = tid; e < K * BV; e += threads) dS[e] *= decay[e / BV];
    });
    // dS_n = Diag(e^{γ_C}) dS + (Q̄ ⊙ e^γ)ᵀ dO - Wᵀ dV^new.
    blk.each_warp([&](int w) {
      warp_tiles(w, kKdaTcWarps, K, BV, [&](int64_t r, int64_t c) {
        typename M::Acc acc;
        M::load_acc(acc, dS + r * BV + c, BV);
        tile_mma<M, true>(acc, Qd + r, K, dO + c, BV, 0, C);
        tile_mma<M, true>(acc, W + r, K, dV + c, BV, 0, C);
        M::store_acc(dS + r * BV + c, acc, BV);
      });
    });
  }
  blk.each([&](int tid) {
    for (int64_t e = tid; e < K * BV; e += threads)
      a.grad_state0[task * KV + e / BV * V + column0 + e % BV] = T(dS[e]);
  });
}

}  // namespace moetrain::simt
