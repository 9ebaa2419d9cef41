// The chunked KDA's state products on tensor cores (TF32 operands, f32
// accumulation): bodies of kernels in kda_cuda.cu that replace the scalar
// kda_chunk_scan, kda_chunk_output and kda_chunk_backward_scan of kda_simt.h
// when cuda::set_kda_tensor_cores(true) (the trainer's choice for bf16 runs and
// train.tf32) and the shape allows (K, V and C multiples of 16). Written once for
// the GPU and the host (ops/simt.h): TF32 tiles of 16x16x8 are wmma on the GPU
// and HostTf32 on the host (the same operands rounded to TF32 the same way,
// products and sums in f32), so tests/ops/kda_tc_test.cpp runs these very
// bodies on the CPU against the scalar bodies and the CPU kernels.
//
// Why these three: they hold the chunked form's state products, about three
// quarters of its FLOPs at K = V = 128, C = 64 (per chunk and value head:
// V^new = U - W S_n and S_{n+1} = Diag(e^{γ_C}) S_n + (K ⊙ e^{γ_C-γ})^T V^new in
// the scan, O = (Q̄ ⊙ e^γ) S_n + A^qk V^new, and the backward scan's
// dV^new = A^qkᵀ dO + (K ⊙ e^{γ_C-γ}) dS, dS_n = Diag(e^{γ_C}) dS + (Q̄ ⊙ e^γ)ᵀ dO
// - Wᵀ dV^new); kda_chunk_grad (kda_simt.h) takes a policy of this file for its
// five C x K x V products (V^new, dW, dK̂, dO S_nᵀ). The scans keep a [K, BV] tile of S (of dS) in f32 shared memory
// through all chunks: the state accumulates in f32 (MODEL_SPEC §12); only the
// operands of each product are rounded to TF32 (fla rounds them to bf16).
// A block is 4 warps; warp w takes the 16x16 output tiles w, w + 4, ... of a
// product; thread phases stage, scale and write back. Every sum runs in a fixed
// order: a run repeats itself bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "ops/kda_simt.h"
#include "ops/simt.h"

#if defined(__CUDACC__)
#include <mma.h>
#endif

namespace moetrain::simt {

inline constexpr int kKdaTcWarps = 4;
inline constexpr int kKdaTcThreads = 32 * kKdaTcWarps;

// Whether the tensor-core bodies take a shape: K, V and C multiples of 16.
inline bool kda_tc_shape_ok(int64_t K, int64_t V, int64_t C) { return K % 16 == 0 && V % 16 == 0 && C % 16 == 0; }
// Columns of S per scan block: 32 (more blocks for the few tasks of a long
// sequence), 16 when V is not a multiple of 32.
inline int64_t kda_tc_tile_columns(int64_t V) { return V % 32 == 0 ? 32 : 16; }

// f32 elements of `sh` for the bodies below.
inline int64_t kda_tc_scan_shared_elements(int64_t K, int64_t C, int64_t BV) { return (K + C) * BV; }
inline int64_t kda_tc_backward_scan_shared_elements(int64_t K, int64_t C, int64_t BV) { return (K + 2 * C) * BV; }
inline int64_t kda_tc_output_shared_elements(int64_t C, int64_t V) { return C * V; }

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
      for (int64_t t = w; t < (C / 16) * (BV / 16); t += kKdaTcWarps) {
        const int64_t r = t / (BV / 16) * 16, c = t % (BV / 16) * 16;
        typename M::Acc acc;
        M::load_acc(acc, U + r * V + c, V);
        for (int64_t kk = 0; kk < K; kk += 8) {
          typename M::TileA x;
          typename M::TileB y;
          M::load_a(x, W + r * K + kk, K);
          M::negate(x);
          M::load_b(y, S + kk * BV + c, BV);
          M::mma(acc, x, y);
        }
        M::store_acc(Vn + r * BV + c, acc, BV);
      }
    });
    blk.each([&](int tid) {
      for (int64_t e = tid; e < C * BV; e += threads) Vnew[e / BV * V + e % BV] = Vn[e];
      for (int64_t e = tid; e < K * BV; e += threads) S[e] *= decay[e / BV];
    });
    // S_{n+1} = Diag(e^{γ_C}) S_n + (K ⊙ e^{γ_C-γ})ᵀ V^new.
    blk.each_warp([&](int w) {
      for (int64_t t = w; t < (K / 16) * (BV / 16); t += kKdaTcWarps) {
        const int64_t r = t / (BV / 16) * 16, c = t % (BV / 16) * 16;
        typename M::Acc acc;
        M::load_acc(acc, S + r * BV + c, BV);
        for (int64_t kk = 0; kk < C; kk += 8) {
          typename M::TileAt x;
          typename M::TileB y;
          M::load_at(x, Kd + kk * K + r, K);
          M::load_b(y, Vn + kk * BV + c, BV);
          M::mma(acc, x, y);
        }
        M::store_acc(S + r * BV + c, acc, BV);
      }
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
    for (int64_t t = w; t < (C / 16) * (V / 16); t += kKdaTcWarps) {
      const int64_t r = t / (V / 16) * 16, c = t % (V / 16) * 16;
      typename M::Acc acc;
      M::zero(acc);
      for (int64_t kk = 0; kk < K; kk += 8) {
        typename M::TileA x;
        typename M::TileB y;
        M::load_a(x, Qd + r * K + kk, K);
        M::load_b(y, Sn + kk * V + c, V);
        M::mma(acc, x, y);
      }
      for (int64_t kk = 0; kk < r + 16; kk += 8) {
        typename M::TileA x;
        typename M::TileB y;
        M::load_a(x, Aqk + r * C + kk, C);
        M::load_b(y, Vnew + kk * V + c, V);
        M::mma(acc, x, y);
      }
      M::store_acc(O + r * V + c, acc, V);
    }
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
      for (int64_t t = w; t < (C / 16) * (BV / 16); t += kKdaTcWarps) {
        const int64_t r = t / (BV / 16) * 16, c = t % (BV / 16) * 16;
        typename M::Acc acc;
        M::zero(acc);
        for (int64_t kk = r; kk < C; kk += 8) {
          typename M::TileAt x;
          typename M::TileB y;
          M::load_at(x, Aqk + kk * C + r, C);
          M::load_b(y, dO + kk * BV + c, BV);
          M::mma(acc, x, y);
        }
        for (int64_t kk = 0; kk < K; kk += 8) {
          typename M::TileA x;
          typename M::TileB y;
          M::load_a(x, Kd + r * K + kk, K);
          M::load_b(y, dS + kk * BV + c, BV);
          M::mma(acc, x, y);
        }
        M::store_acc(dV + r * BV + c, acc, BV);
      }
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
      for (int64_t t = w; t < (K / 16) * (BV / 16); t += kKdaTcWarps) {
        const int64_t r = t / (BV / 16) * 16, c = t % (BV / 16) * 16;
        typename M::Acc acc;
        M::load_acc(acc, dS + r * BV + c, BV);
        for (int64_t kk = 0; kk < C; kk += 8) {
          typename M::TileAt x;
          typename M::TileB y;
          M::load_at(x, Qd + kk * K + r, K);
          M::load_b(y, dO + kk * BV + c, BV);
          M::mma(acc, x, y);
          M::load_at(x, W + kk * K + r, K);
          M::load_b(y, dV + kk * BV + c, BV);
          M::mma(acc, x, y);
        }
        M::store_acc(dS + r * BV + c, acc, BV);
      }
    });
  }
  blk.each([&](int tid) {
    for (int64_t e = tid; e < K * BV; e += threads)
      a.grad_state0[task * KV + e / BV * V + column0 + e % BV] = T(dS[e]);
  });
}

}  // namespace moetrain::simt
