// The bodies of the CUDA recurrent KDA and linear-attention kernels
// (kda_cuda.cu), written once for the GPU and the host. A body runs one task
// (batch element b, value head hv) on one thread block as a sequence of
// phases: blk.each(f) runs f(tid) for every thread tid of the block, then a
// barrier. On the GPU each() is `f(threadIdx.x); __syncthreads();`; on the host
// (HostBlock) it is a loop over tid, so tests/ops/kda/kda_simt_test.cpp runs these
// very bodies on the CPU against the CPU kernels (kda_cpu.cpp,
// linear_attention_cpu.cpp): indexing, recurrences, checkpoints and the
// BPTT backward are tested on machines without a GPU; only the launch is not.
// The blocks and the phase rule: ops/simt.h.
//
// Math (ops/kda/kda.h, docs/model.md#kda-recurrent-form): S' = Diag(α) S, α = e^g; δ = v - S'^T k;
// S = S' + β k δ^T; o = S^T (scale q). Linear attention (ops/linear_attention/linear_attention.h)
// is the same loop without the delta rule: δ = v, α = 1, β = 1, scale 1.
// Parallel layout: the forward and the first backward phase give each thread
// columns j of S (the columns evolve independently); the backward's sums over
// columns (dq, dk, dg, dβ) give each thread rows d. S, the segment's states
// and dS live in global scratch of the arithmetic type A (f32 for bf16
// storage: the state is f32, docs/model.md#mixed-precision); the per-step vectors in `sh`
// (shared memory on the GPU), kda_simt_shared_elements(K, V) elements.
// Every sum runs in a fixed order: the same bits every run.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/common/simt.h"
#include "ops/common/tf32_tiles.h"

namespace moetrain::simt {

// T: storage type of the tensors; A: arithmetic type of the state and scratch.
// Shapes as in ops/kda/kda.h (linear attention: HV = H, g and beta unused). Tasks are
// b·HV + hv; the scratch and state arrays are task-major.
// What the recurrent and the chunked bodies both read: shapes, scale, inputs.
template <class T, class A>
struct KdaInputs {
  int64_t B = 0, Tn = 0, H = 0, HV = 0, K = 0, V = 0;
  A scale = 1;
  const T *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;

  MT_HOST_DEVICE int64_t tasks() const { return B * HV; }
};

template <class T, class A>
struct KdaSimtArgs : KdaInputs<T, A> {
  using KdaInputs<T, A>::B;
  using KdaInputs<T, A>::Tn;
  using KdaInputs<T, A>::H;
  using KdaInputs<T, A>::HV;
  using KdaInputs<T, A>::K;
  using KdaInputs<T, A>::V;
  int64_t segment = 64;   // steps between checkpoints
  bool delta_rule = true;  // false: linear attention
  // forward
  T* o = nullptr;            // [B, T, HV, V]
  T* state = nullptr;        // [tasks, K, V]: S_0 in, S_T out
  A* work = nullptr;         // [tasks, K, V]: S while running
  A* checkpoints = nullptr;  // null, or [tasks, segments, K, V]: S before steps 0, segment, 2·segment, ...
  // backward (reads checkpoints)
  const T* grad_o = nullptr;      // [B, T, HV, V]
  const T* grad_state = nullptr;  // [tasks, K, V]: dS_T
  A* states = nullptr;            // [tasks, segment + 1, K, V]: one segment's states, recomputed
  A* deltas = nullptr;            // [tasks, segment, V]: their δ
  A* dS = nullptr;                // [tasks, K, V]
  A* dq = nullptr;                // [B, T, HV, K]: per value head (summed over groups afterwards)
  A* dk = nullptr;                // [B, T, HV, K]
  T* grad_v = nullptr;            // [B, T, HV, V]
  T* grad_g = nullptr;            // [B, T, HV, K] (delta rule only)
  T* grad_beta = nullptr;         // [B, T, HV] (delta rule only)
  T* grad_state0 = nullptr;       // [tasks, K, V]: dS_0

  MT_HOST_DEVICE int64_t segments() const { return (Tn + segment - 1) / segment; }
  MT_HOST_DEVICE int64_t qk_row(int64_t b, int64_t t, int64_t hv) const { return ((b * Tn + t) * H + hv / (HV / H)) * K; }
  MT_HOST_DEVICE int64_t gk_row(int64_t b, int64_t t, int64_t hv) const { return ((b * Tn + t) * HV + hv) * K; }
  MT_HOST_DEVICE int64_t v_row(int64_t b, int64_t t, int64_t hv) const { return ((b * Tn + t) * HV + hv) * V; }
};

// Elements of `sh`: scale·q, k, α, the dβ parts (K each), do, dδ (V each), β.
inline int64_t kda_simt_shared_elements(int64_t K, int64_t V) { return 4 * K + 2 * V + 1; }

template <class A>
struct StepVectors {
  A *q, *k, *alpha, *part, *grad_o, *grad_delta, *beta;
  MT_HOST_DEVICE StepVectors(A* sh, int64_t K, int64_t V)
      : q(sh), k(sh + K), alpha(sh + 2 * K), part(sh + 3 * K), grad_o(sh + 4 * K), grad_delta(sh + 4 * K + V),
        beta(sh + 4 * K + 2 * V) {}
};

// Thread tid's share of loading step t: scale·q, k, α = e^g, β.
template <class T, class A>
MT_HOST_DEVICE void load_step(const KdaSimtArgs<T, A>& a, const StepVectors<A>& s, int64_t b, int64_t t, int64_t hv,
                              int tid, int threads) {
  const int64_t qk = a.qk_row(b, t, hv), gk = a.gk_row(b, t, hv);
  for (int64_t d = tid; d < a.K; d += threads) {
    s.q[d] = a.scale * static_cast<A>(a.q[qk + d]);
    s.k[d] = static_cast<A>(a.k[qk + d]);
    s.alpha[d] = a.delta_rule ? exp_a(static_cast<A>(a.g[gk + d])) : A(1);
  }
  if (tid == 0) *s.beta = a.delta_rule ? static_cast<A>(a.beta[(b * a.Tn + t) * a.HV + hv]) : A(1);
}

// Column j of one step from S_in [K, V] into S_out (may be S_in): returns δ_j, sets *o = o_j.
template <class A>
MT_HOST_DEVICE A column_step(const A* S_in, A* S_out, int64_t j, int64_t K, int64_t V, const StepVectors<A>& s,
                             bool delta_rule, A v_j, A* o) {
  A acc = 0;
  for (int64_t d = 0; d < K; ++d) {
    A x = S_in[d * V + j];
    if (delta_rule) {
      x *= s.alpha[d];
      acc += s.k[d] * x;
    }
    S_out[d * V + j] = x;
  }
  const A delta = v_j - acc, c = *s.beta * delta;
  A out = 0;
  for (int64_t d = 0; d < K; ++d) {
    A x = S_out[d * V + j] + s.k[d] * c;
    S_out[d * V + j] = x;
    out += s.q[d] * x;
  }
  *o = out;
  return delta;
}

// Forward of task `task`: o, the final state, and the checkpoints when asked.
MT_SIMT_BODY
template <class Block, class T, class A>
MT_HOST_DEVICE void kda_simt_forward(const Block& blk, const KdaSimtArgs<T, A>& a, int64_t task, A* sh) {
  const int n = blk.threads;
  const int64_t K = a.K, V = a.V, KV = K * V, b = task / a.HV, hv = task % a.HV, nseg = a.segments();
  const StepVectors<A> s(sh, K, V);
  A* S = a.work + task * KV;
  T* state = a.state + task * KV;
  blk.each([&](int tid) {
    for (int64_t e = tid; e < KV; e += n) S[e] = static_cast<A>(state[e]);
  });
  for (int64_t t = 0; t < a.Tn; ++t) {
    blk.each([&](int tid) {
      if (a.checkpoints && t % a.segment == 0) {
        A* cp = a.checkpoints + (task * nseg + t / a.segment) * KV;
        for (int64_t e = tid; e < KV; e += n) cp[e] = S[e];
      }
      load_step(a, s, b, t, hv, tid, n);
    });
    blk.each([&](int tid) {
      const int64_t row = a.v_row(b, t, hv);
      for (int64_t j = tid; j < V; j += n) {
        A o;
        column_step(S, S, j, K, V, s, a.delta_rule, static_cast<A>(a.v[row + j]), &o);
        a.o[row + j] = T(o);
      }
    });
  }
  blk.each([&](int tid) {
    for (int64_t e = tid; e < KV; e += n) state[e] = T(S[e]);
  });
}

// BPTT backward of task `task`, segment by segment from the last: the segment's
// states are recomputed from its checkpoint, then its steps run in reverse.
MT_SIMT_BODY
template <class Block, class T, class A>
MT_HOST_DEVICE void kda_simt_backward(const Block& blk, const KdaSimtArgs<T, A>& a, int64_t task, A* sh) {
  const int n = blk.threads;
  const int64_t K = a.K, V = a.V, KV = K * V, b = task / a.HV, hv = task % a.HV, R = a.segment,
                nseg = a.segments();
  const StepVectors<A> s(sh, K, V);
  A* dS = a.dS + task * KV;
  A* states = a.states + task * (R + 1) * KV;
  A* deltas = a.deltas + task * R * V;
  blk.each([&](int tid) {
    for (int64_t e = tid; e < KV; e += n) dS[e] = static_cast<A>(a.grad_state[task * KV + e]);
  });
  for (int64_t seg = nseg - 1; seg >= 0; --seg) {
    const int64_t t0 = seg * R, count = a.Tn - t0 < R ? a.Tn - t0 : R;
    blk.each([&](int tid) {
      const A* cp = a.checkpoints + (task * nseg + seg) * KV;
      for (int64_t e = tid; e < KV; e += n) states[e] = cp[e];
    });
    for (int64_t i = 0; i < count; ++i) {
      blk.each([&](int tid) { load_step(a, s, b, t0 + i, hv, tid, n); });
      blk.each([&](int tid) {
        const int64_t row = a.v_row(b, t0 + i, hv);
        for (int64_t j = tid; j < V; j += n) {
          A o;
          deltas[i * V + j] =
              column_step(states + i * KV, states + (i + 1) * KV, j, K, V, s, a.delta_rule, static_cast<A>(a.v[row + j]), &o);
        }
      });
    }
    for (int64_t i = count - 1; i >= 0; --i) {
      const int64_t t = t0 + i, vrow = a.v_row(b, t, hv), gk = a.gk_row(b, t, hv);
      blk.each([&](int tid) {
        load_step(a, s, b, t, hv, tid, n);
        for (int64_t j = tid; j < V; j += n) s.grad_o[j] = static_cast<A>(a.grad_o[vrow + j]);
      });
      // Columns: dS += (scale q) do^T; dδ = β dS^T k (= dv).
      blk.each([&](int tid) {
        for (int64_t j = tid; j < V; j += n) {
          const A go = s.grad_o[j];
          A u = 0;
          for (int64_t d = 0; d < K; ++d) {
            A x = dS[d * V + j] + s.q[d] * go;
            dS[d * V + j] = x;
            u += s.k[d] * x;
          }
          const A dd = *s.beta * u;
          s.grad_delta[j] = dd;
          a.grad_v[vrow + j] = T(dd);
        }
      });
      // Rows: dq = scale S_t do; r = dS δ; dk = β r - S' dδ; dS' = dS - k dδ^T;
      // dg = rowsum(dS' ⊙ S'); dS_{t-1} = Diag(α) dS'; dβ parts k_d r_d.
      blk.each([&](int tid) {
        const A* delta = deltas + i * V;
        for (int64_t d = tid; d < K; d += n) {
          const A* St = states + (i + 1) * KV + d * V;
          const A* Sp = states + i * KV + d * V;
          A* ds = dS + d * V;
          const A alpha = s.alpha[d], kd = s.k[d];
          A sq = 0, r = 0, sdd = 0, dg = 0;
          for (int64_t j = 0; j < V; ++j) {
            sq += St[j] * s.grad_o[j];
            r += ds[j] * delta[j];
          }
          if (a.delta_rule) {
            for (int64_t j = 0; j < V; ++j) {
              const A sp = alpha * Sp[j], dsp = ds[j] - kd * s.grad_delta[j];
              sdd += sp * s.grad_delta[j];
              dg += sp * dsp;
              ds[j] = alpha * dsp;
            }
            a.grad_g[gk + d] = T(dg);
          }
          a.dq[gk + d] = a.scale * sq;
          a.dk[gk + d] = *s.beta * r - sdd;
          s.part[d] = kd * r;
        }
      });
      if (a.delta_rule)
        blk.each([&](int tid) {
          if (tid != 0) return;
          A sum = 0;
          for (int64_t d = 0; d < K; ++d) sum += s.part[d];
          a.grad_beta[(b * a.Tn + t) * a.HV + hv] = T(sum);
        });
    }
  }
  blk.each([&](int tid) {
    for (int64_t e = tid; e < KV; e += n) a.grad_state0[task * KV + e] = T(dS[e]);
  });
}

// ---------------------------------------------------------------------------------------------------
// Chunked forward (docs/model.md#kda-chunked-forward) in three bodies: kda_chunk_prepare per (task,
// chunk n), all chunks at once: γ (double), A^qk, A^kk (in `sh`), M = (I + A^kk)^{-1}
// by forward substitution (row i in phase i), W, U, Q̄ ⊙ e^γ, K ⊙ e^{γ_C - γ}, e^{γ_C};
// kda_chunk_scan per (task, column j): the only sequential part, chunk after
// chunk, V^new = U - W S_n and S_{n+1} = Diag(e^{γ_C}) S_n + (K ⊙ e^{γ_C-γ})^T V^new,
// saving every S_n; kda_chunk_output per (task, chunk): O = (Q̄ ⊙ e^γ) S_n + A^qk V^new.
// Pairs use exp(γ_i - γ_j) with i >= j only (exponent <= 0, docs/model.md#kda-exponent-rule stability rule); the
// last chunk may be shorter (its rows past the end count as absent). The backward
// (docs/model.md#kda-chunked-backward) has the same shape: prepare again, a reverse scan over chunks per column
// of dS (kda_chunk_backward_scan), then every chunk at once (kda_chunk_grad).
template <class T, class A>
struct KdaChunkArgs : KdaInputs<T, A> {
  using KdaInputs<T, A>::HV;
  using KdaInputs<T, A>::Tn;
  int64_t C = 64;
  T* o = nullptr;          // [B, T, HV, V]
  T* state = nullptr;      // [tasks, K, V]: S_0 in, S_T out
  A* work = nullptr;       // [tasks, K, V]: S while scanning
  A* states = nullptr;     // [tasks, chunks, K, V]: S_n entering each chunk
  double* gamma = nullptr; // [tasks, chunks, C, K]: within-chunk cumulative log decay
  A* Aqk = nullptr;        // [tasks, chunks, C, C]
  A* N = nullptr;          // [tasks, chunks, C, C]: M - I, strictly lower
  A* W = nullptr;          // [tasks, chunks, C, K]
  A* Qd = nullptr;         // [tasks, chunks, C, K]: Q̄ ⊙ e^γ
  A* Kd = nullptr;         // [tasks, chunks, C, K]: K ⊙ e^{γ_C - γ}
  A* U = nullptr;          // [tasks, chunks, C, V]
  A* Vnew = nullptr;       // [tasks, chunks, C, V]
  A* decay = nullptr;      // [tasks, chunks, K]: e^{γ_C}
  // backward (kda_chunk_backward_scan, kda_chunk_grad; prepare recomputes the above)
  A* Ekk = nullptr;            // null, or [tasks, chunks, C, C]: A^kk without β (prepare writes it)
  const T* grad_o = nullptr;   // [B, T, HV, V]
  const T* grad_state = nullptr;  // [tasks, K, V]: dS_T
  A* dS = nullptr;             // [tasks, K, V] while scanning back
  A* dS_exit = nullptr;        // [tasks, chunks, K, V]: dS_{n+1}, the gradient of each chunk's exit state
  A* dVnew = nullptr;          // [tasks, chunks, C, V]
  A *dW = nullptr, *dKd = nullptr, *dOS = nullptr, *dKe = nullptr, *dgamma = nullptr;  // [tasks, chunks, C, K]
  A *dAqk = nullptr, *dTm = nullptr, *Y = nullptr, *dAkk = nullptr;                  // [tasks, chunks, C, C]
  A* dbeta = nullptr;          // [tasks, chunks, 2C]: β's gradient through Tm, then through A^kk
  A *dq = nullptr, *dk = nullptr;  // [B, T, HV, K] per value head
  T *grad_v = nullptr, *grad_g = nullptr, *grad_beta = nullptr, *grad_state0 = nullptr;

  MT_HOST_DEVICE int64_t chunks() const { return (Tn + C - 1) / C; }
  MT_HOST_DEVICE int64_t rows(int64_t n) const { return Tn - n * C < C ? Tn - n * C : C; }
  // Offset of (task, chunk n) in an array of `per` elements per chunk.
  MT_HOST_DEVICE int64_t at(int64_t task, int64_t n, int64_t per) const { return (task * chunks() + n) * per; }
};

// Rows per sub-chunk of kda_chunk_prepare's A^qk / A^kk factorisation.
inline constexpr int64_t kKdaSubChunk = 16;

// Elements of `sh` for kda_chunk_prepare: A^kk (C x C) and β (C).
inline int64_t kda_chunk_shared_elements(int64_t C) { return C * C + C; }

// The sub-chunks of a chunk of `rows` rows, and whether its pairwise decays
// e^{γ_i - γ_j} go through the sub-chunk factorisation (kda_chunk_prepare): more
// than one sub-chunk, and the middle factors (count² K) fit a C x C array.
struct SubChunks {
  int64_t count;
  bool factored;
};
MT_HOST_DEVICE inline SubChunks sub_chunks(int64_t rows, int64_t K, int64_t C) {
  const int64_t count = (rows + kKdaSubChunk - 1) / kKdaSubChunk;
  return {count, count > 1 && count * count * K <= C * C};
}

// Mma: void, or a TF32 tile policy of ops/common/tf32_tiles.h (A = float; K, V, C
// multiples of 16): then W = M Diag(β)(K ⊙ e^γ) and U = M Diag(β) V run as tile
// products on the warps, with Diag(β) V staged as f32 in V^new (written by the scan after).
MT_SIMT_BODY
template <class Mma = void, class Block, class T, class A>
MT_HOST_DEVICE void kda_chunk_prepare(const Block& blk, const KdaChunkArgs<T, A>& a, int64_t task, int64_t n, A* sh) {
  const int threads = blk.threads;
  const int64_t K = a.K, V = a.V, C = a.C, b = task / a.HV, hv = task % a.HV, rows = a.rows(n), t0 = n * C;
  const int64_t qk_stride = a.H * K, gk_stride = a.HV * K, v_stride = a.HV * V;
  const T* q = a.q + ((b * a.Tn + t0) * a.H + hv / (a.HV / a.H)) * K;  // row i at q + i * qk_stride
  const T* k = a.k + ((b * a.Tn + t0) * a.H + hv / (a.HV / a.H)) * K;
  const T* g = a.g + ((b * a.Tn + t0) * a.HV + hv) * K;
  const T* v = a.v + ((b * a.Tn + t0) * a.HV + hv) * V;
  double* gamma = a.gamma + a.at(task, n, C * K);
  A *Aqk = a.Aqk + a.at(task, n, C * C), *N = a.N + a.at(task, n, C * C);
  A *W = a.W + a.at(task, n, C * K), *Qd = a.Qd + a.at(task, n, C * K), *Kd = a.Kd + a.at(task, n, C * K);
  A *U = a.U + a.at(task, n, C * V), *decay = a.decay + a.at(task, n, K);
  A *Akk = sh, *beta = sh + C * C;
  // γ, column by column; β.
  blk.each([&](int tid) {
    for (int64_t d = tid; d < K; d += threads) {
      double acc = 0;
      for (int64_t i = 0; i < rows; ++i) {
        acc += static_cast<double>(static_cast<A>(g[i * gk_stride + d]));
        gamma[i * K + d] = acc;
      }
    }
    for (int64_t i = tid; i < C; i += threads)
      beta[i] = i < rows ? static_cast<A>(a.beta[(b * a.Tn + t0 + i) * a.HV + hv]) : A(0);
  });
  // A^qk (i >= j) and A^kk (i > j) by sub-chunks of kKdaSubChunk rows (fla's
  // factorisation, docs/model.md#kda-exponent-rule): for j in an earlier sub-chunk than i,
  //   e^{γ_i - γ_j} = e^{γ_i - γ_r} · e^{γ_r - γ_e} · e^{γ_e - γ_j},
  // r the first row of i's sub-chunk, e the first row after j's (j < e <= r <= i):
  // three factors <= 1 (the docs/model.md#kda-exponent-rule stability rule holds), the outer two one exp per row
  // and channel, the middle one per pair of sub-chunks; pairs inside one sub-chunk
  // take exp(γ_i - γ_j) directly. The factored rows live in W, Qd and Kd (written
  // for good in the last phases), the middle factors in N (zeroed after).
  // (Mid needs subs² K <= C² elements: K <= 256 for C a multiple of 16; otherwise
  // every pair is computed directly.)
  const SubChunks split = sub_chunks(rows, K, C);
  const int64_t subs = split.count;
  const bool factored = split.factored;
  A *Qr = W, *Kr = Qd, *Ke = Kd, *Mid = N;  // Mid[(a, b), d]: e^{γ_{16a} - γ_{16b}}, b <= a
  if (factored) blk.each([&](int tid) {
    for (int64_t e = tid; e < rows * K; e += threads) {
      const int64_t i = e / K, d = e % K, r = i / kKdaSubChunk * kKdaSubChunk, next = r + kKdaSubChunk;
      const A to_start = exp_a(static_cast<A>(gamma[i * K + d] - gamma[r * K + d]));
      Qr[e] = static_cast<A>(q[i * qk_stride + d]) * to_start;
      Kr[e] = static_cast<A>(k[i * qk_stride + d]) * to_start;
      Ke[e] = next < rows ? static_cast<A>(k[i * qk_stride + d]) *
                                exp_a(static_cast<A>(gamma[next * K + d] - gamma[i * K + d]))
                          : A(0);
    }
    for (int64_t e = tid; e < subs * subs * K; e += threads) {
      const int64_t sa = e / (subs * K), sb = e / K % subs, d = e % K;
      if (sb >= 1 && sb <= sa)
        Mid[e] = exp_a(static_cast<A>(gamma[sa * kKdaSubChunk * K + d] - gamma[sb * kKdaSubChunk * K + d]));
    }
  });
  blk.each([&](int tid) {
    for (int64_t e = tid; e < C * C; e += threads) {
      const int64_t i = e / C, j = e % C, si = i / kKdaSubChunk, sj = j / kKdaSubChunk;
      A qk = 0, kk = 0;
      if (i < rows && j <= i) {
        if (!factored || si == sj) {
          for (int64_t d = 0; d < K; ++d) {
            const A decay_ij = exp_a(static_cast<A>(gamma[i * K + d] - gamma[j * K + d]));
            const A kj = static_cast<A>(k[j * qk_stride + d]) * decay_ij;
            qk += static_cast<A>(q[i * qk_stride + d]) * kj;
            kk += static_cast<A>(k[i * qk_stride + d]) * kj;
          }
        } else {
          const A* mid = Mid + (si * subs + sj + 1) * K;
          for (int64_t d = 0; d < K; ++d) {
            const A kj = mid[d] * Ke[j * K + d];
            qk += Qr[i * K + d] * kj;
            kk += Kr[i * K + d] * kj;
          }
        }
        qk *= a.scale;
      }
      Aqk[e] = qk;
      if (a.Ekk) a.Ekk[a.at(task, n, C * C) + e] = j < i ? kk : A(0);
      Akk[e] = j < i ? beta[i] * kk : A(0);
    }
  });
  // N is zeroed; Kd holds Diag(β) (K ⊙ e^γ) until the last phase (one exp per row and
  // channel, not one per pair in W's sum; rows past a short chunk 0).
  A* Vb = a.Vnew + a.at(task, n, C * V);  // Mma: Diag(β) V
  blk.each([&](int tid) {
    for (int64_t e = tid; e < C * C; e += threads) N[e] = 0;
    for (int64_t e = tid; e < C * K; e += threads) {
      const int64_t i = e / K, d = e % K;
      Kd[e] = i < rows ? beta[i] * static_cast<A>(k[i * qk_stride + d]) * exp_a(static_cast<A>(gamma[e])) : A(0);
    }
    if constexpr (!std::is_void_v<Mma>)
      for (int64_t e = tid; e < C * V; e += threads)
        Vb[e] = e / V < rows ? beta[e / V] * static_cast<A>(v[e / V * v_stride + e % V]) : A(0);
  });
  // N = (I + A^kk)^{-1} - I, row i from the rows above it:
  // N[i,j] = -A^kk[i,j] - Σ_{j<m<i} A^kk[i,m] N[m,j].
  for (int64_t i = 1; i < rows; ++i)
    blk.each([&](int tid) {
      for (int64_t j = tid; j < i; j += threads) {
        A acc = Akk[i * C + j];
        for (int64_t m = j + 1; m < i; ++m) acc += Akk[i * C + m] * N[m * C + j];
        N[i * C + j] = -acc;
      }
    });
  // W = M Diag(β) (K ⊙ e^γ), U = M Diag(β) V, Q̄ ⊙ e^γ, e^{γ_C}.
  const double* gamma_C = gamma + (rows - 1) * K;
  if constexpr (!std::is_void_v<Mma>) {
    // Row tile r: (I + N) X = X + N X, N strictly lower (columns < r + 16).
    blk.each_warp([&](int w) {
      auto times_m = [&](const A* X, int64_t D, A* out) {
        return [=](int64_t r, int64_t c) {
          typename Mma::Acc acc;
          Mma::load_acc(acc, X + r * D + c, D);
          tile_mma<Mma>(acc, N + r * C, C, X + c, D, 0, r + 16);
          Mma::store_acc(out + r * D + c, acc, D);
        };
      };
      const int64_t next = warp_tiles(w, threads / 32, C, K, times_m(Kd, K, W));
      warp_tiles(w, threads / 32, C, V, times_m(Vb, V, U), next);
    });
  }
  blk.each([&](int tid) {
    for (int64_t e = tid; e < C * K; e += threads) {
      const int64_t i = e / K, d = e % K;
      Qd[e] = i < rows ? a.scale * static_cast<A>(q[i * qk_stride + d]) * exp_a(static_cast<A>(gamma[e])) : A(0);
    }
    if constexpr (std::is_void_v<Mma>) {
      for (int64_t e = tid; e < C * K; e += threads) {
        const int64_t i = e / K, d = e % K;
        A w = 0;
        if (i < rows)
          for (int64_t j = 0; j <= i; ++j) w += (j == i ? A(1) : N[i * C + j]) * Kd[j * K + d];
        W[e] = w;
      }
      for (int64_t e = tid; e < C * V; e += threads) {
        const int64_t i = e / V, c = e % V;
        A u = 0;
        if (i < rows)
          for (int64_t j = 0; j <= i; ++j)
            u += (j == i ? A(1) : N[i * C + j]) * beta[j] * static_cast<A>(v[j * v_stride + c]);
        U[e] = u;
      }
    }
    for (int64_t d = tid; d < K; d += threads) decay[d] = exp_a(static_cast<A>(gamma_C[d]));
  });
  // K ⊙ e^{γ_C - γ}.
  blk.each([&](int tid) {
    for (int64_t e = tid; e < C * K; e += threads) {
      const int64_t i = e / K, d = e % K;
      Kd[e] = i < rows ? static_cast<A>(k[i * qk_stride + d]) * exp_a(static_cast<A>(gamma_C[d] - gamma[e])) : A(0);
    }
  });
}

// Column j of task `task` through every chunk (one phase: columns are independent).
MT_SIMT_BODY
template <class Block, class T, class A>
MT_HOST_DEVICE void kda_chunk_scan(const Block& blk, const KdaChunkArgs<T, A>& a, int64_t task, int64_t column0) {
  const int64_t K = a.K, V = a.V, C = a.C, KV = K * V;
  A* S = a.work + task * KV;
  T* state = a.state + task * KV;
  blk.each([&](int tid) {
    const int64_t j = column0 + tid;
    if (j >= V) return;
    for (int64_t d = 0; d < K; ++d) S[d * V + j] = static_cast<A>(state[d * V + j]);
    for (int64_t n = 0; n < a.chunks(); ++n) {
      const int64_t rows = a.rows(n);
      A* Sn = a.states + a.at(task, n, KV);
      const A *W = a.W + a.at(task, n, C * K), *Kd = a.Kd + a.at(task, n, C * K), *U = a.U + a.at(task, n, C * V);
      const A* decay = a.decay + a.at(task, n, K);
      A* Vnew = a.Vnew + a.at(task, n, C * V);
      for (int64_t d = 0; d < K; ++d) Sn[d * V + j] = S[d * V + j];
      for (int64_t i = 0; i < rows; ++i) {
        A acc = U[i * V + j];
        for (int64_t d = 0; d < K; ++d) acc -= W[i * K + d] * S[d * V + j];
        Vnew[i * V + j] = acc;
      }
      for (int64_t i = rows; i < C; ++i) Vnew[i * V + j] = 0;  // as the tensor-core scan writes them
      for (int64_t d = 0; d < K; ++d) {
        A acc = decay[d] * S[d * V + j];
        for (int64_t i = 0; i < rows; ++i) acc += Kd[i * K + d] * Vnew[i * V + j];
        S[d * V + j] = acc;
      }
    }
    for (int64_t d = 0; d < K; ++d) state[d * V + j] = T(S[d * V + j]);
  });
}

// O of chunk n of task `task`: element (i, c) per thread.
MT_SIMT_BODY
template <class Block, class T, class A>
MT_HOST_DEVICE void kda_chunk_output(const Block& blk, const KdaChunkArgs<T, A>& a, int64_t task, int64_t n) {
  const int threads = blk.threads;
  const int64_t K = a.K, V = a.V, C = a.C, b = task / a.HV, hv = task % a.HV, rows = a.rows(n);
  const A *Sn = a.states + a.at(task, n, K * V), *Qd = a.Qd + a.at(task, n, C * K);
  const A *Aqk = a.Aqk + a.at(task, n, C * C), *Vnew = a.Vnew + a.at(task, n, C * V);
  blk.each([&](int tid) {
    for (int64_t e = tid; e < rows * V; e += threads) {
      const int64_t i = e / V, c = e % V;
      A acc = 0;
      for (int64_t d = 0; d < K; ++d) acc += Qd[i * K + d] * Sn[d * V + c];
      for (int64_t m = 0; m <= i; ++m) acc += Aqk[i * C + m] * Vnew[m * V + c];
      a.o[((b * a.Tn + n * C + i) * a.HV + hv) * V + c] = T(acc);
    }
  });
}

// Backward of the chunked form (docs/model.md#kda-chunked-backward), after kda_chunk_prepare has run
// again with Ekk set and the chunk states S_n are at hand. First the reverse scan
// over chunks per (task, column j), the sequential part:
//   dV^new = A^qk^T dO + (K ⊙ e^{γ_C-γ}) dS;  dS_n = Diag(e^{γ_C}) dS + (Q̄ ⊙ e^γ)^T dO - W^T dV^new,
// saving every chunk's dS (of its exit state) and dV^new; dS_0 goes to grad_state0.
MT_SIMT_BODY
template <class Block, class T, class A>
MT_HOST_DEVICE void kda_chunk_backward_scan(const Block& blk, const KdaChunkArgs<T, A>& a, int64_t task,
                                            int64_t column0) {
  const int64_t K = a.K, V = a.V, C = a.C, KV = K * V, b = task / a.HV, hv = task % a.HV;
  A* dS = a.dS + task * KV;
  blk.each([&](int tid) {
    const int64_t j = column0 + tid;
    if (j >= V) return;
    for (int64_t d = 0; d < K; ++d) dS[d * V + j] = static_cast<A>(a.grad_state[task * KV + d * V + j]);
    for (int64_t n = a.chunks() - 1; n >= 0; --n) {
      const int64_t rows = a.rows(n);
      const T* grad_o = a.grad_o + ((b * a.Tn + n * C) * a.HV + hv) * V + j;  // row i at grad_o[i * HV * V]
      const int64_t o_stride = a.HV * V;
      const A *Aqk = a.Aqk + a.at(task, n, C * C), *Kd = a.Kd + a.at(task, n, C * K);
      const A *Qd = a.Qd + a.at(task, n, C * K), *W = a.W + a.at(task, n, C * K), *decay = a.decay + a.at(task, n, K);
      A *dS_exit = a.dS_exit + a.at(task, n, KV), *dVnew = a.dVnew + a.at(task, n, C * V);
      for (int64_t d = 0; d < K; ++d) dS_exit[d * V + j] = dS[d * V + j];
      for (int64_t i = 0; i < rows; ++i) {
        A acc = 0;
        for (int64_t d = 0; d < K; ++d) acc += Kd[i * K + d] * dS[d * V + j];
        for (int64_t m = i; m < rows; ++m) acc += Aqk[m * C + i] * static_cast<A>(grad_o[m * o_stride]);
        dVnew[i * V + j] = acc;
      }
      for (int64_t i = rows; i < C; ++i) dVnew[i * V + j] = 0;  // as the tensor-core scan writes them
      for (int64_t d = 0; d < K; ++d) {
        A acc = decay[d] * dS[d * V + j];
        for (int64_t i = 0; i < rows; ++i)
          acc += Qd[i * K + d] * static_cast<A>(grad_o[i * o_stride]) - W[i * K + d] * dVnew[i * V + j];
        dS[d * V + j] = acc;
      }
    }
    for (int64_t d = 0; d < K; ++d) a.grad_state0[task * KV + d * V + j] = T(dS[d * V + j]);
  });
}

// The rest of the backward, per (task, chunk n), every chunk at once: dv, dβ, dg and
// the per-value-head dq, dk of the chunk's rows (names as in docs/model.md#kda-chunked-backward; M = I + N,
// Tm = M Diag(β), dW = -dV^new S_n^T, dK̂ = V^new dS^T, dOS = dO S_n^T, dKe = d(K ⊙ e^γ)).
MT_SIMT_BODY
//
// Mma: void, or a TF32 tile policy of ops/common/tf32_tiles.h (A = float; K, V, C multiples of
// 16): then the phases up to dV and dKe, the body's products of C x K x V and
// C x C x V/K (all its matrix products but Y and dA^kk's C x C x C), run as tile
// products on the warps (V^new's rows past a short chunk 0), with dO and then dV
// staged as f32 in U and V as f32 in V^new.
template <class Mma = void, class Block, class T, class A>
MT_HOST_DEVICE void kda_chunk_grad(const Block& blk, const KdaChunkArgs<T, A>& a, int64_t task, int64_t n) {
  const int threads = blk.threads;
  const int64_t K = a.K, V = a.V, C = a.C, KV = K * V, b = task / a.HV, hv = task % a.HV, rows = a.rows(n),
                t0 = n * C;
  const int64_t qk_stride = a.H * K, v_stride = a.HV * V;
  const T* q = a.q + ((b * a.Tn + t0) * a.H + hv / (a.HV / a.H)) * K;
  const T* k = a.k + ((b * a.Tn + t0) * a.H + hv / (a.HV / a.H)) * K;
  const T* v = a.v + ((b * a.Tn + t0) * a.HV + hv) * V;
  const T* grad_o = a.grad_o + ((b * a.Tn + t0) * a.HV + hv) * V;
  const T* beta_in = a.beta + (b * a.Tn + t0) * a.HV + hv;  // row i at beta_in[i * HV]
  const double* gamma = a.gamma + a.at(task, n, C * K);
  const A *Sn = a.states + a.at(task, n, KV), *dSx = a.dS_exit + a.at(task, n, KV);
  const A *N = a.N + a.at(task, n, C * C), *Ekk = a.Ekk + a.at(task, n, C * C);
  const A* Kd = a.Kd + a.at(task, n, C * K);
  A *W = a.W + a.at(task, n, C * K), *U = a.U + a.at(task, n, C * V);  // read in the first phase, scratch after it
  const A *dVnew = a.dVnew + a.at(task, n, C * V), *decay = a.decay + a.at(task, n, K);
  A* Vnew = a.Vnew + a.at(task, n, C * V);
  A *dW = a.dW + a.at(task, n, C * K), *dKd = a.dKd + a.at(task, n, C * K), *dOS = a.dOS + a.at(task, n, C * K);
  A *dKe = a.dKe + a.at(task, n, C * K), *dgamma = a.dgamma + a.at(task, n, C * K);
  A *dAqk = a.dAqk + a.at(task, n, C * C), *dTm = a.dTm + a.at(task, n, C * C), *Y = a.Y + a.at(task, n, C * C);
  A *dAkk = a.dAkk + a.at(task, n, C * C), *dbeta = a.dbeta + a.at(task, n, 2 * C);
  auto M = [&](int64_t i, int64_t j) { return i == j ? A(1) : N[i * C + j]; };
  auto beta = [&](int64_t i) { return static_cast<A>(beta_in[i * a.HV]); };
  auto dO = [&](int64_t i, int64_t c) { return static_cast<A>(grad_o[i * v_stride + c]); };
  if constexpr (!std::is_void_v<Mma>) {
    const int warps = threads / 32;
    // V^new = U - W S_n.
    blk.each_warp([&](int w) {
      warp_tiles(w, warps, C, V, [&](int64_t r, int64_t c) {
        typename Mma::Acc acc;
        Mma::load_acc(acc, U + r * V + c, V);
        tile_mma<Mma>(acc, W + r * K, K, Sn + c, V, 0, K, true);
        Mma::store_acc(Vnew + r * V + c, acc, V);
      });
    });
    // dO as f32 operands in U; W (read in the phase before) holds K ⊙ e^γ from here on.
    A* dOf = U;
    blk.each([&](int tid) {
      for (int64_t e = tid; e < C * V; e += threads) dOf[e] = e / V < rows ? dO(e / V, e % V) : A(0);
      for (int64_t e = tid; e < rows * K; e += threads)
        W[e] = static_cast<A>(k[e / K * qk_stride + e % K]) * exp_a(static_cast<A>(gamma[e]));
    });
    // dW = -dV^new S_nᵀ, dK̂ = V^new dSᵀ, dO S_nᵀ: [C, K] tiles over V.
    blk.each_warp([&](int w) {
      auto times_t = [&](const A* X, const A* Y, A* out, bool negate) {
        return [=](int64_t r, int64_t c) {
          typename Mma::Acc acc;
          Mma::zero(acc);
          tile_mma<Mma, false, true>(acc, X + r * V, V, Y + c * V, V, 0, V, negate);
          Mma::store_acc(out + r * K + c, acc, K);
        };
      };
      int64_t next = warp_tiles(w, warps, C, K, times_t(dVnew, Sn, dW, true));
      next = warp_tiles(w, warps, C, K, times_t(Vnew, dSx, dKd, false), next);
      warp_tiles(w, warps, C, K, times_t(dOf, Sn, dOS, false), next);
    });
    // dA^qk = dO V^newᵀ and dTm = dW (K ⊙ e^γ)ᵀ on the lower block triangle (dO in U);
    // what lies above the diagonal or past the chunk's rows is never read, left as is.
    blk.each_warp([&](int w) {
      auto lower = [&](const A* X, const A* Y, int64_t D, A* out) {
        return [=](int64_t r, int64_t c) {
          if (c > r) return;
          typename Mma::Acc acc;
          Mma::zero(acc);
          tile_mma<Mma, false, true>(acc, X + r * D, D, Y + c * D, D, 0, D);
          Mma::store_acc(out + r * C + c, acc, C);
        };
      };
      const int64_t next = warp_tiles(w, warps, C, C, lower(U, Vnew, V, dAqk));
      warp_tiles(w, warps, C, C, lower(dW, W, K, dTm), next);
    });
    // V as f32 operands in V^new (read for the last time above).
    blk.each([&](int tid) {
      for (int64_t e = tid; e < C * V; e += threads)
        Vnew[e] = e / V < rows ? static_cast<A>(v[e / V * v_stride + e % V]) : A(0);
    });
    // dTm += dU Vᵀ; (I + N)ᵀ dU into U (dO read for the last time above) and (I + N)ᵀ dW
    // into dKe (N[l, i] != 0 for l > i only); Diag(β) after.
    blk.each_warp([&](int w) {
      auto times_mt = [&](const A* X, int64_t D, A* out) {
        return [=](int64_t r, int64_t c) {
          typename Mma::Acc acc;
          Mma::load_acc(acc, X + r * D + c, D);
          tile_mma<Mma, true>(acc, N + r, C, X + c, D, r, C);
          Mma::store_acc(out + r * D + c, acc, D);
        };
      };
      int64_t next = warp_tiles(w, warps, C, C, [&](int64_t r, int64_t c) {
        if (c > r) return;
        typename Mma::Acc acc;
        Mma::load_acc(acc, dTm + r * C + c, C);
        tile_mma<Mma, false, true>(acc, dVnew + r * V, V, Vnew + c * V, V, 0, V);
        Mma::store_acc(dTm + r * C + c, acc, C);
      });
      next = warp_tiles(w, warps, C, V, times_mt(dVnew, V, U), next);
      warp_tiles(w, warps, C, K, times_mt(dW, K, dKe), next);
    });
    // dβ_j through Tm = Σ_i dTm[i,j] M[i,j].
    blk.each([&](int tid) {
      for (int64_t e = tid; e < rows * V; e += threads)
        a.grad_v[((b * a.Tn + t0 + e / V) * a.HV + hv) * V + e % V] = T(beta(e / V) * U[e]);
      for (int64_t e = tid; e < rows * K; e += threads) dKe[e] *= beta(e / K);
      for (int64_t j = tid; j < rows; j += threads) {
        A acc = 0;
        for (int64_t i = j; i < rows; ++i) acc += dTm[i * C + j] * M(i, j);
        dbeta[j] = acc;
      }
    });
  } else {
    // V^new = U - W S_n.
    blk.each([&](int tid) {
      for (int64_t e = tid; e < rows * V; e += threads) {
        const int64_t i = e / V, c = e % V;
        A acc = U[e];
        for (int64_t d = 0; d < K; ++d) acc -= W[i * K + d] * Sn[d * V + c];
        Vnew[e] = acc;
      }
    });
    // dW, dK̂, dO S_n^T; W (read in the phase before) holds K ⊙ e^γ from here on.
    blk.each([&](int tid) {
      for (int64_t e = tid; e < rows * K; e += threads) {
        const int64_t i = e / K, d = e % K;
        W[e] = static_cast<A>(k[i * qk_stride + d]) * exp_a(static_cast<A>(gamma[e]));
        A w = 0, kd = 0, os = 0;
        for (int64_t c = 0; c < V; ++c) {
          w -= dVnew[i * V + c] * Sn[d * V + c];
          kd += Vnew[i * V + c] * dSx[d * V + c];
          os += dO(i, c) * Sn[d * V + c];
        }
        dW[e] = w;
        dKd[e] = kd;
        dOS[e] = os;
      }
    });
    // dA^qk = Tril(dO V^new^T); dTm = dU V^T + dW (K ⊙ e^γ)^T (lower incl. the diagonal).
    blk.each([&](int tid) {
      for (int64_t e = tid; e < C * C; e += threads) {
        const int64_t i = e / C, j = e % C;
        A qk = 0, tm = 0;
        if (i < rows && j <= i) {
          for (int64_t c = 0; c < V; ++c) {
            qk += dO(i, c) * Vnew[j * V + c];
            tm += dVnew[i * V + c] * static_cast<A>(v[j * v_stride + c]);
          }
          for (int64_t d = 0; d < K; ++d) tm += dW[i * K + d] * W[j * K + d];
        }
        dAqk[e] = qk;
        dTm[e] = tm;
      }
    });
    // dV = Tm^T dU; dKe = Tm^T dW; dβ_j through Tm = Σ_i dTm[i,j] M[i,j].
    blk.each([&](int tid) {
      for (int64_t e = tid; e < rows * V; e += threads) {
        const int64_t i = e / V, c = e % V;
        A acc = 0;
        for (int64_t l = i; l < rows; ++l) acc += M(l, i) * dVnew[l * V + c];
        a.grad_v[((b * a.Tn + t0 + i) * a.HV + hv) * V + c] = T(beta(i) * acc);
      }
      for (int64_t e = tid; e < rows * K; e += threads) {
        const int64_t i = e / K, d = e % K;
        A acc = 0;
        for (int64_t l = i; l < rows; ++l) acc += M(l, i) * dW[l * K + d];
        dKe[e] = beta(i) * acc;
      }
      for (int64_t j = tid; j < rows; j += threads) {
        A acc = 0;
        for (int64_t i = j; i < rows; ++i) acc += dTm[i * C + j] * M(i, j);
        dbeta[j] = acc;
      }
    });
  }
  // Y = M^T dM, dM = dTm Diag(β).
  blk.each([&](int tid) {
    for (int64_t e = tid; e < C * C; e += threads) {
      const int64_t i = e / C, j = e % C;
      A acc = 0;
      if (i < rows && j < rows)
        for (int64_t l = i > j ? i : j; l < rows; ++l) acc += M(l, i) * dTm[l * C + j] * beta(j);
      Y[e] = acc;
    }
  });
  // dA^kk = -StrictTril(Y M^T). Beside it, the factors of the pairwise decays for the
  // next phase, as kda_chunk_prepare factors them (r the first row of i's sub-chunk,
  // e the first row after it): e^{γ_i - γ_r} in dW, e^{γ_e - γ_i} in W (0 in the last
  // sub-chunk), the middle factors in dTm (dW, W and dTm are read for the last time
  // by the phases above).
  const SubChunks split = sub_chunks(rows, K, C);
  const int64_t subs = split.count;
  const bool factored = split.factored;
  A *to_start = dW, *to_next = W, *Mid = dTm;  // Mid[(a, b), d]: e^{γ_{16a} - γ_{16b}}, 1 <= b <= a
  blk.each([&](int tid) {
    for (int64_t e = tid; e < C * C; e += threads) {
      const int64_t i = e / C, j = e % C;
      A acc = 0;
      if (i < rows && j < i)
        for (int64_t l = 0; l <= j; ++l) acc += Y[i * C + l] * M(j, l);
      dAkk[e] = -acc;
    }
    if (!factored) return;
    for (int64_t e = tid; e < rows * K; e += threads) {
      const int64_t i = e / K, d = e % K, r = i / kKdaSubChunk * kKdaSubChunk, next = r + kKdaSubChunk;
      to_start[e] = exp_a(static_cast<A>(gamma[e] - gamma[r * K + d]));
      to_next[e] = next < rows ? exp_a(static_cast<A>(gamma[next * K + d] - gamma[e])) : A(0);
    }
    for (int64_t e = tid; e < subs * subs * K; e += threads) {
      const int64_t sa = e / (subs * K), sb = e / K % subs, d = e % K;
      if (sb >= 1 && sb <= sa)
        Mid[e] = exp_a(static_cast<A>(gamma[sa * kKdaSubChunk * K + d] - gamma[sb * kKdaSubChunk * K + d]));
    }
  });
  // dβ_i through A^kk; the pairwise and inter-chunk terms of dq̄, dk and dγ. A pair
  // (i, m) inside one sub-chunk takes its decay directly; with m in an earlier
  // sub-chunk sm, the decay is e^{γ_i - γ_r} Mid[si, sm + 1] e^{γ_e - γ_m}, so the
  // sub-chunk's terms are summed first and scaled once (likewise for the column).
  blk.each([&](int tid) {
    for (int64_t i = tid; i < rows; i += threads) {
      A acc = 0;
      for (int64_t j = 0; j < i; ++j) acc += dAkk[i * C + j] * Ekk[i * C + j];
      dbeta[C + i] = acc;
    }
    const double* gamma_C = gamma + (rows - 1) * K;
    for (int64_t e = tid; e < rows * K; e += threads) {
      const int64_t i = e / K, d = e % K, si = i / kKdaSubChunk;
      const int64_t first = factored ? si * kKdaSubChunk : 0;
      const int64_t end = factored && (si + 1) * kKdaSubChunk < rows ? (si + 1) * kKdaSubChunk : rows;
      const double gi = gamma[i * K + d];
      const A qi = a.scale * static_cast<A>(q[i * qk_stride + d]), ki = static_cast<A>(k[i * qk_stride + d]);
      A dq = 0, dk = 0, dg = 0;
      for (int64_t m = first; m <= i; ++m) {  // row i of A^qk and A^kk
        const A decay_im = exp_a(static_cast<A>(gi - gamma[m * K + d])), km = static_cast<A>(k[m * qk_stride + d]);
        const A tq = dAqk[i * C + m] * decay_im;
        dq += tq * km;
        dg += tq * qi * km;
        if (m < i) {
          const A tk = beta(i) * dAkk[i * C + m] * decay_im;
          dk += tk * km;
          dg += tk * ki * km;
        }
      }
      for (int64_t m = i; m < end; ++m) {  // column i
        const A decay_mi = exp_a(static_cast<A>(gamma[m * K + d] - gi));
        const A qm = a.scale * static_cast<A>(q[m * qk_stride + d]), km = static_cast<A>(k[m * qk_stride + d]);
        const A tq = dAqk[m * C + i] * decay_mi;
        dk += tq * qm;
        dg -= tq * qm * ki;
        if (m > i) {
          const A tk = beta(m) * dAkk[m * C + i] * decay_mi;
          dk += tk * km;
          dg -= tk * km * ki;
        }
      }
      if (factored) {
        for (int64_t sm = 0; sm < si; ++sm) {  // row i, earlier sub-chunks (full ones)
          A pq = 0, pk = 0;
          for (int64_t m = sm * kKdaSubChunk; m < (sm + 1) * kKdaSubChunk; ++m) {
            const A km = static_cast<A>(k[m * qk_stride + d]) * to_next[m * K + d];
            pq += dAqk[i * C + m] * km;
            pk += dAkk[i * C + m] * km;
          }
          const A f = to_start[e] * Mid[(si * subs + sm + 1) * K + d];
          dq += f * pq;
          dk += f * beta(i) * pk;
          dg += f * (qi * pq + beta(i) * ki * pk);
        }
        for (int64_t sm = si + 1; sm < subs; ++sm) {  // column i, later sub-chunks
          A p = 0;
          const int64_t m_end = (sm + 1) * kKdaSubChunk < rows ? (sm + 1) * kKdaSubChunk : rows;
          for (int64_t m = sm * kKdaSubChunk; m < m_end; ++m)
            p += (dAqk[m * C + i] * a.scale * static_cast<A>(q[m * qk_stride + d]) +
                  beta(m) * dAkk[m * C + i] * static_cast<A>(k[m * qk_stride + d])) *
                 to_start[m * K + d];
          const A f = to_next[e] * Mid[(sm * subs + si + 1) * K + d];
          dk += f * p;
          dg -= f * ki * p;
        }
      }
      const A ei = exp_a(static_cast<A>(gi)), fi = exp_a(static_cast<A>(gamma_C[d] - gi));
      dq += dOS[e] * ei;
      dg += dOS[e] * qi * ei;
      dk += dKe[e] * ei;
      dg += dKe[e] * ki * ei;
      dk += dKd[e] * fi;
      dg -= dKd[e] * ki * fi;
      const int64_t row = ((b * a.Tn + t0 + i) * a.HV + hv) * K + d;
      a.dq[row] = a.scale * dq;
      a.dk[row] = dk;
      dgamma[e] = dg;
    }
  });
  // dγ_C, then dg = the reverse cumulative sum of dγ within the chunk; dβ.
  blk.each([&](int tid) {
    for (int64_t d = tid; d < K; d += threads) {
      A acc = 0, sd = 0;
      for (int64_t i = 0; i < rows; ++i) acc += dKd[i * K + d] * Kd[i * K + d];
      for (int64_t c = 0; c < V; ++c) sd += dSx[d * V + c] * Sn[d * V + c];
      acc += decay[d] * sd;
      for (int64_t i = rows - 1; i >= 0; --i) {
        acc += dgamma[i * K + d];
        a.grad_g[((b * a.Tn + t0 + i) * a.HV + hv) * K + d] = T(acc);
      }
    }
    for (int64_t i = tid; i < rows; i += threads)
      a.grad_beta[(b * a.Tn + t0 + i) * a.HV + hv] = T(dbeta[i] + dbeta[C + i]);
  });
}

// Element e of grad [B, T, H, K] = Σ over the group's G value heads of per_value_head
// [B, T, HV = H·G, K], in order.
template <class T, class A>
MT_HOST_DEVICE void group_sum_element(T* grad, const A* per_value_head, int64_t e, int64_t G, int64_t K) {
  const int64_t row = e / K, c = e % K;
  const A* in = per_value_head + row * G * K + c;
  A sum = in[0];
  for (int64_t j = 1; j < G; ++j) sum += in[j * K];
  grad[e] = T(sum);
}

}  // namespace moetrain::simt
