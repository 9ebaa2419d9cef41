// Linear-attention kernels (ops/linear_attention/linear_attention.h): the recurrent form with a
// forward + reverse sweep backward, and the chunked form with GEMMs per chunk.
// One task per (batch, head), tasks in parallel (parallel_for), each running its
// steps or chunks in order; arithmetic in the input dtype. A task's rows of a
// [B, T, H, D] tensor are a matrix with leading dimension H·D, which the GEMMs
// take directly (no copies).
#include <algorithm>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/linear_attention/linear_attention_kernels.h"

namespace moetrain::cpu {
namespace {

struct LinearAttentionDims {
  int64_t B, T, H, K, V;
  LinearAttentionDims(const Tensor& q, const Tensor& v)
      : B(q.size(0)), T(q.size(1)), H(q.size(2)), K(q.size(3)), V(v.size(3)) {}
  int64_t tasks() const { return B * H; }
  // Offset of row 0 of task (b, h) in a [B, T, H, D] tensor; rows are D·H apart.
  int64_t row0(int64_t task, int64_t D) const { return (task / H) * T * H * D + (task % H) * D; }
};

// S += k v^T; o = S^T q (one step of one task).
template <class T>
void linear_attention_step(T* S, T* o, const T* q, const T* k, const T* v, int64_t K, int64_t V) {
  for (int64_t d = 0; d < K; ++d) {
    const T kd = k[d];
    T* row = S + d * V;
    for (int64_t e = 0; e < V; ++e) row[e] += kd * v[e];
  }
  std::fill(o, o + V, T(0));
  for (int64_t d = 0; d < K; ++d) {
    const T qd = q[d];
    const T* row = S + d * V;
    for (int64_t e = 0; e < V; ++e) o[e] += qd * row[e];
  }
}

// Zero the strict upper triangle of a row-major n x n matrix.
template <class T>
void keep_lower(T* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) std::fill(a + i * n + i + 1, a + (i + 1) * n, T(0));
}

}  // namespace

void linear_attention_recurrent_forward(Tensor& o, Tensor& state, const Tensor& q, const Tensor& k, const Tensor& v) {
  dispatch_float(q.dtype(), "linear_attention_recurrent", [&](auto tag) {
    using T = decltype(tag);
    LinearAttentionDims d(q, v);
    const int64_t KV = d.K * d.V, sk = d.H * d.K, sv = d.H * d.V;
    parallel_for(d.tasks(), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task) {
        const T* qr = q.data<T>() + d.row0(task, d.K);
        const T* kr = k.data<T>() + d.row0(task, d.K);
        const T* vr = v.data<T>() + d.row0(task, d.V);
        T* orow = o.data<T>() + d.row0(task, d.V);
        T* S = state.data<T>() + task * KV;
        for (int64_t t = 0; t < d.T; ++t)
          linear_attention_step(S, orow + t * sv, qr + t * sk, kr + t * sk, vr + t * sv, d.K, d.V);
      }
    });
  });
}

void linear_attention_recurrent_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_h0,
                                         const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                                         const Tensor& k, const Tensor& v, const Tensor& h0) {
  dispatch_float(q.dtype(), "linear_attention_recurrent_backward", [&](auto tag) {
    using T = decltype(tag);
    LinearAttentionDims d(q, v);
    const int64_t KV = d.K * d.V, sk = d.H * d.K, sv = d.H * d.V;
    parallel_for(d.tasks(), 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> S(static_cast<size_t>(KV));
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t ok = d.row0(task, d.K), ov = d.row0(task, d.V);
        const T *qr = q.data<T>() + ok, *kr = k.data<T>() + ok, *vr = v.data<T>() + ov;
        const T* dor = grad_o.data<T>() + ov;
        T *dq = grad_q.data<T>() + ok, *dk = grad_k.data<T>() + ok, *dv = grad_v.data<T>() + ov;
        // Forward sweep: dq_t = S_t do_t.
        if (h0.defined())
          std::copy(h0.data<T>() + task * KV, h0.data<T>() + (task + 1) * KV, S.begin());
        else
          std::fill(S.begin(), S.end(), T(0));
        for (int64_t t = 0; t < d.T; ++t) {
          const T *kt = kr + t * sk, *vt = vr + t * sv, *dot = dor + t * sv;
          T* dqt = dq + t * sk;
          for (int64_t a = 0; a < d.K; ++a) {
            T* row = S.data() + a * d.V;
            T acc = 0;
            for (int64_t e = 0; e < d.V; ++e) {
              row[e] += kt[a] * vt[e];
              acc += row[e] * dot[e];
            }
            dqt[a] = acc;
          }
        }
        // Reverse sweep: G = dS_t = dS_T + Σ_{s>=t} q_s do_s^T; dk_t = G v_t, dv_t = G^T k_t.
        T* G = grad_h0.data<T>() + task * KV;
        std::copy(grad_final_state.data<T>() + task * KV, grad_final_state.data<T>() + (task + 1) * KV, G);
        for (int64_t t = d.T - 1; t >= 0; --t) {
          const T *qt = qr + t * sk, *kt = kr + t * sk, *vt = vr + t * sv, *dot = dor + t * sv;
          T *dkt = dk + t * sk, *dvt = dv + t * sv;
          std::fill(dvt, dvt + d.V, T(0));
          for (int64_t a = 0; a < d.K; ++a) {
            T* row = G + a * d.V;
            T acc = 0;
            for (int64_t e = 0; e < d.V; ++e) {
              row[e] += qt[a] * dot[e];
              acc += row[e] * vt[e];
              dvt[e] += row[e] * kt[a];
            }
            dkt[a] = acc;
          }
        }
      }
    });
  });
}

void linear_attention_chunked_forward(Tensor& o, Tensor& state, Tensor* chunk_states, const Tensor& q,
                                      const Tensor& k, const Tensor& v, int64_t chunk_size) {
  dispatch_float(q.dtype(), "linear_attention_chunked", [&](auto tag) {
    using T = decltype(tag);
    LinearAttentionDims d(q, v);
    const int64_t KV = d.K * d.V, sk = d.H * d.K, sv = d.H * d.V, C = chunk_size;
    const int64_t nchunks = linear_attention_num_chunks(d.T, C);
    T* cs = chunk_states ? chunk_states->data<T>() : nullptr;
    parallel_for(d.tasks(), 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> A(static_cast<size_t>(C * C));
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t ok = d.row0(task, d.K), ov = d.row0(task, d.V);
        T* S = state.data<T>() + task * KV;
        for (int64_t n = 0; n < nchunks; ++n) {
          const int64_t t0 = n * C, c = std::min(C, d.T - t0);
          const T *Q = q.data<T>() + ok + t0 * sk, *Km = k.data<T>() + ok + t0 * sk, *Vm = v.data<T>() + ov + t0 * sv;
          T* O = o.data<T>() + ov + t0 * sv;
          if (cs) std::copy(S, S + KV, cs + (task * nchunks + n) * KV);
          gemm(false, true, c, c, d.K, T(1), Q, sk, Km, sk, T(0), A.data(), c);  // A = Q K^T
          keep_lower(A.data(), c);
          gemm(false, false, c, d.V, d.K, T(1), Q, sk, S, d.V, T(0), O, sv);         // O = Q S_n
          gemm(false, false, c, d.V, c, T(1), A.data(), c, Vm, sv, T(1), O, sv);     //   + Tril(Q K^T) V
          gemm(true, false, d.K, d.V, c, T(1), Km, sk, Vm, sv, T(1), S, d.V);        // S += K^T V
        }
      }
    });
  });
}

void linear_attention_chunked_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_h0,
                                       const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& chunk_states,
                                       int64_t chunk_size) {
  dispatch_float(q.dtype(), "linear_attention_chunked_backward", [&](auto tag) {
    using T = decltype(tag);
    LinearAttentionDims d(q, v);
    const int64_t KV = d.K * d.V, sk = d.H * d.K, sv = d.H * d.V, C = chunk_size;
    const int64_t nchunks = linear_attention_num_chunks(d.T, C);
    const T* cs = chunk_states.data<T>();
    parallel_for(d.tasks(), 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> A(static_cast<size_t>(C * C)), dA(static_cast<size_t>(C * C));
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t ok = d.row0(task, d.K), ov = d.row0(task, d.V);
        T* G = grad_h0.data<T>() + task * KV;  // dS of the current chunk's exit state; ends as dS_0
        std::copy(grad_final_state.data<T>() + task * KV, grad_final_state.data<T>() + (task + 1) * KV, G);
        for (int64_t n = nchunks - 1; n >= 0; --n) {
          const int64_t t0 = n * C, c = std::min(C, d.T - t0);
          const T *Q = q.data<T>() + ok + t0 * sk, *Km = k.data<T>() + ok + t0 * sk, *Vm = v.data<T>() + ov + t0 * sv;
          const T* dO = grad_o.data<T>() + ov + t0 * sv;
          const T* Sn = cs + (task * nchunks + n) * KV;
          T *dQ = grad_q.data<T>() + ok + t0 * sk, *dK = grad_k.data<T>() + ok + t0 * sk;
          T* dV = grad_v.data<T>() + ov + t0 * sv;
          gemm(false, true, c, c, d.K, T(1), Q, sk, Km, sk, T(0), A.data(), c);  // A = Tril(Q K^T)
          keep_lower(A.data(), c);
          gemm(false, true, c, c, d.V, T(1), dO, sv, Vm, sv, T(0), dA.data(), c);  // dA = Tril(dO V^T)
          keep_lower(dA.data(), c);
          gemm(false, true, c, d.K, d.V, T(1), dO, sv, Sn, d.V, T(0), dQ, sk);     // dQ = dO S_n^T
          gemm(false, false, c, d.K, c, T(1), dA.data(), c, Km, sk, T(1), dQ, sk);  //    + dA K
          gemm(true, false, c, d.K, c, T(1), dA.data(), c, Q, sk, T(0), dK, sk);
          gemm(false, true, c, d.K, d.V, T(1), Vm, sv, G, d.V, T(1), dK, sk);       // dK = dA^T Q + V G^T
          gemm(true, false, c, d.V, c, T(1), A.data(), c, dO, sv, T(0), dV, sv);
          gemm(false, false, c, d.V, d.K, T(1), Km, sk, G, d.V, T(1), dV, sv);      // dV = A^T dO + K G
          gemm(true, false, d.K, d.V, c, T(1), Q, sk, dO, sv, T(1), G, d.V);        // dS_n = G + Q^T dO
        }
      }
    });
  });
}

}  // namespace moetrain::cpu
