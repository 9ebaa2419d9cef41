// The bodies of the CUDA recurrent KDA and linear-attention kernels
// (kda_cuda.cu), written once for the GPU and the host. A body runs one task
// (batch element b, value head hv) on one thread block as a sequence of
// phases: blk.each(f) runs f(tid) for every thread tid of the block, then a
// barrier. On the GPU each() is `f(threadIdx.x); __syncthreads();`; on the host
// (HostBlock) it is a loop over tid, so tests/ops/kda_simt_test.cpp runs these
// very bodies on the CPU against the CPU kernels (kda_cpu.cpp,
// linear_attention_cpu.cpp): indexing, recurrences, checkpoints and the
// BPTT backward are tested on machines without a GPU; only the launch is not.
// The rule that makes the host loop faithful to the GPU: within one phase a
// thread writes only what it owns and reads nothing that another thread writes
// in the same phase.
//
// Math (ops/kda.h, MODEL_SPEC §5): S' = Diag(α) S, α = e^g; δ = v - S'^T k;
// S = S' + β k δ^T; o = S^T (scale q). Linear attention (ops/linear_attention.h)
// is the same loop without the delta rule: δ = v, α = 1, β = 1, scale 1.
// Parallel layout: the forward and the first backward phase give each thread
// columns j of S (the columns evolve independently); the backward's sums over
// columns (dq, dk, dg, dβ) give each thread rows d. S, the segment's states
// and dS live in global scratch of the arithmetic type A (f32 for bf16
// storage: the state is f32, MODEL_SPEC §12); the per-step vectors in `sh`
// (shared memory on the GPU), kda_simt_shared_elements(K, V) elements.
// Every sum runs in a fixed order: the same bits every run.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
// Before a body template: its host instantiation may call the device's each().
#define MT_SIMT_BODY _Pragma("nv_exec_check_disable")
#else
#define MT_HOST_DEVICE
#define MT_SIMT_BODY
#endif

namespace moetrain::simt {

// The host's block: each(f) runs f(0), ..., f(threads - 1) in turn.
struct HostBlock {
  int threads;
  template <class F>
  void each(F&& f) const {
    for (int tid = 0; tid < threads; ++tid) f(tid);
  }
};

MT_HOST_DEVICE inline float exp_a(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
MT_HOST_DEVICE inline double exp_a(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}

// T: storage type of the tensors; A: arithmetic type of the state and scratch.
// Shapes as in ops/kda.h (linear attention: HV = H, g and beta unused). Tasks are
// b·HV + hv; the scratch and state arrays are task-major.
template <class T, class A>
struct KdaSimtArgs {
  int64_t B = 0, Tn = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t segment = 64;   // steps between checkpoints
  A scale = 1;
  bool delta_rule = true;  // false: linear attention
  const T *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
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

  MT_HOST_DEVICE int64_t tasks() const { return B * HV; }
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
