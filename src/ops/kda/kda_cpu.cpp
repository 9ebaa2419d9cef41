// KDA kernels: the recurrent form and its BPTT backward (docs/model.md#kda-recurrent-form), the
// chunked WY/UT form and its backward (docs/model.md#kda-chunked-form). One task per (batch, value head),
// tasks in parallel (parallel_for), each running its steps or chunks in order.
//
// Numerics: arithmetic in the input dtype (f32: fp32 throughout, as fla), except
// the within-chunk cumulative log decays γ, summed in double so that exponent
// differences γ_i - γ_j keep full precision when |γ| is large (strong decay
// reaches |γ| ~ 50·C). The exponent rule
// (docs/model.md#kda-exponent-rule): never exp(γ) and exp(-γ) of one row
// pair separately; the factors are exp(γ_i - γ_j) with i >= j (<= 1 for g <= 0),
// and only the diagonal sub-chunk reference below uses exponents up to +40 (see
// kReferenceSpan). exp is exp_of (ops/common/math.h: for f32 a vectorisable expf within
// 2 ulp, 0 below -87.3).
//
// Speed (docs/kernels.md): the chunked task loops also exist compiled for AVX2 + FMA,
// picked at run time (chunked_tasks_avx2); in-chunk products go through tile_gemm
// (backend/cpu/tile_gemm.h), a register-blocked kernel for these small tiles, not OpenBLAS.
//
// Memory: the recurrent forward saves the state every kKdaRecurrentSegment steps
// and its backward recomputes the states of one segment at a time; the chunked
// forward saves every chunk-entry state S_n and its backward recomputes the
// in-chunk quantities (A^kk, A^qk, M, W, U, V^new) chunk by chunk.
//
// dq and dk of grouped value heads (G > 1) are written per value head into a
// [B, T, HV, K] buffer and then summed over the group in a fixed order, so the
// results do not depend on the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "backend/cpu/tile_gemm.h"
#include "core/dispatch.h"
#include "ops/kda/kda_kernels.h"
#include "ops/common/math.h"

namespace moetrain::cpu {
namespace {

struct Dims {
  int64_t B, T, H, HV, G, K, V;
  Dims(const Tensor& q, const Tensor& v)
      : B(q.size(0)), T(q.size(1)), H(q.size(2)), HV(v.size(2)), G(v.size(2) / q.size(2)), K(q.size(3)), V(v.size(3)) {}
  int64_t tasks() const { return B * HV; }
};

// Rows of one task (b, value head hv) in a [B, T, heads, D] tensor: row t at base + t * stride.
template <class T>
struct Rows {
  T* base = nullptr;
  int64_t stride = 0;
  T* at(int64_t t) const { return base + t * stride; }
};

// The task's rows of q/k ([B,T,H,K], head hv / G), of v/o ([B,T,HV,V]), of g and
// per-value-head dq/dk ([B,T,HV,K]) and of beta ([B,T,HV]).
template <class T>
struct TaskRows {
  Rows<T> q, k, v, g, beta;
};

template <class T>
Rows<T> qk_rows(T* p, const Dims& d, int64_t task) {
  int64_t b = task / d.HV, hv = task % d.HV;
  return {p + (b * d.T * d.H + hv / d.G) * d.K, d.H * d.K};
}
template <class T>
Rows<T> v_rows(T* p, const Dims& d, int64_t task) {
  int64_t b = task / d.HV, hv = task % d.HV;
  return {p + (b * d.T * d.HV + hv) * d.V, d.HV * d.V};
}
template <class T>
Rows<T> gk_rows(T* p, const Dims& d, int64_t task) {
  int64_t b = task / d.HV, hv = task % d.HV;
  return {p + (b * d.T * d.HV + hv) * d.K, d.HV * d.K};
}
template <class T>
Rows<T> beta_rows(T* p, const Dims& d, int64_t task) {
  int64_t b = task / d.HV, hv = task % d.HV;
  return {p + b * d.T * d.HV + hv, d.HV};
}

template <class T>
TaskRows<T> task_rows(const Dims& d, int64_t task, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const Tensor& beta) {
  return {qk_rows(q.data<T>(), d, task), qk_rows(k.data<T>(), d, task), v_rows(v.data<T>(), d, task),
          gk_rows(g.data<T>(), d, task), beta_rows(beta.data<T>(), d, task)};
}

// grad [B,T,H,K] = Σ over each group of G value heads of per_value_head [B,T,HV,K].
template <class T>
void sum_value_head_groups(T* grad, const T* per_value_head, const Dims& d) {
  parallel_for(d.B * d.T * d.H, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      T* out = grad + row * d.K;
      const T* in = per_value_head + row * d.G * d.K;  // row (b,t,h) -> value heads h*G.. of (b,t)
      for (int64_t c = 0; c < d.K; ++c) out[c] = in[c];
      for (int64_t j = 1; j < d.G; ++j)
        for (int64_t c = 0; c < d.K; ++c) out[c] += in[j * d.K + c];
    }
  });
}

// Where a kernel writes dq and dk: straight into the gradients when G = 1, else
// into per-value-head buffers summed afterwards.
struct QkGradTargets {
  Tensor dq, dk;  // [B, T, HV, K]
  QkGradTargets(Tensor& grad_q, Tensor& grad_k, const Dims& d) {
    if (d.G == 1) {
      dq = grad_q;
      dk = grad_k;
    } else {
      dq = empty({d.B, d.T, d.HV, d.K}, grad_q.dtype());
      dk = empty({d.B, d.T, d.HV, d.K}, grad_k.dtype());
    }
  }
  template <class T>
  void finish(Tensor& grad_q, Tensor& grad_k, const Dims& d) {
    if (d.G == 1) return;
    sum_value_head_groups(grad_q.data<T>(), dq.data<T>(), d);
    sum_value_head_groups(grad_k.data<T>(), dk.data<T>(), d);
  }
};

// ---------------------------------------------------------------------------------------------------
// Recurrent form (docs/model.md#kda-recurrent-form)

// One step on S [K, V] in place: S' = Diag(e^g) S; δ = v - S'^T k; S = S' + β k δ^T; o = S^T (scale q).
// Writes o [V] and δ [V]. Shared by the recurrent forward, its backward's recomputation
// and the decode step, so all three produce the same bits.
template <class T>
void recurrent_step(T* S, T* o, T* delta, const T* q, const T* k, const T* v, const T* g, T beta, T scale, int64_t K,
                    int64_t V) {
  for (int64_t j = 0; j < V; ++j) delta[j] = T(0);
  for (int64_t d = 0; d < K; ++d) {
    T a = exp_of(g[d]), kd = k[d];
    T* s = S + d * V;
    for (int64_t j = 0; j < V; ++j) {
      s[j] *= a;
      delta[j] += kd * s[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) delta[j] = v[j] - delta[j];
  for (int64_t j = 0; j < V; ++j) o[j] = T(0);
  for (int64_t d = 0; d < K; ++d) {
    T c = beta * k[d], qd = scale * q[d];
    T* s = S + d * V;
    for (int64_t j = 0; j < V; ++j) {
      s[j] += c * delta[j];
      o[j] += qd * s[j];
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Chunked form (docs/model.md#kda-chunked-form)

// Sub-chunk length for the in-chunk pairwise terms (docs/model.md#kda-exponent-rule, as fla). Off-diagonal
// sub-chunk blocks use the first row n of the row sub-chunk as reference,
// exp(γ_i - γ_j) = exp(γ_i - γ_n) · exp(γ_n - γ_j) (both factors <= 1), which turns
// them into matmuls. A diagonal block is a matmul too, with its middle row m as
// reference, when every |γ_i - γ_m| in it is at most kReferenceSpan: the factors
// then lie in [e^-40, e^40], far inside the f32 range (the bound fla's lower-bound
// gate guarantees by g >= -5, for f64 too, so that tests see both paths).
// Otherwise (stronger decay) the block is computed pair by pair, exp(γ_i - γ_j)
// with i >= j only.
constexpr int64_t kSubChunk = 16;
constexpr double kReferenceSpan = 40.0;

inline int64_t tri(int64_t n) { return n * (n + 1) / 2; }

// out[d] = exp(a[d] - b[d]), d < n: the difference in double, the exp in T. Two
// passes, so that each loop has one element type and vectorises.
template <class T>
void exp_of_difference(T* out, const double* a, const double* b, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<T>(a[d] - b[d]);
  for (int64_t d = 0; d < n; ++d) out[d] = exp_of(out[d]);
}

// out = 1 / a over n elements.
template <class T>
void reciprocal(T* __restrict out, const T* __restrict a, int64_t n) {
  for (int64_t x = 0; x < n; ++x) out[x] = T(1) / a[x];
}

// out = a ⊙ b over n elements (separate arrays; restrict lets the loop vectorise).
template <class T>
void multiply(T* __restrict out, const T* __restrict a, const T* __restrict b, int64_t n) {
  for (int64_t x = 0; x < n; ++x) out[x] = a[x] * b[x];
}

// Workspace and per-chunk quantities of one task. prepare() loads a chunk and
// computes what depends on the chunk alone; forward() / backward() add the entry state.
template <class T, int Bytes>
class KdaChunk {
 public:
  KdaChunk(int64_t C, int64_t K, int64_t V) : C_(C), K_(K), V_(V) {
    int64_t nsub = (C + kSubChunk - 1) / kSubChunk;
    auto ck = static_cast<size_t>(C * K), cc = static_cast<size_t>(C * C);
    for (auto* b : {&q_, &k_, &eg_, &eh_, &qg_, &kg_, &kh_, &rowdec_, &qrow_, &krow_, &drow_, &dcol_, &qdiag_,
                    &kdiag_, &kdcol_, &W_, &dW_, &dq_, &dk_plus_, &dk_minus_, &dkh_})
      b->resize(ck);
    for (auto* b : {&E_, &Aqk_, &M_, &Tm_, &dAqk_, &dTm_, &dM_, &dAkk_, &tmpc_}) b->resize(cc);
    for (auto* b : {&v_, &Vn_, &dVn_}) b->resize(static_cast<size_t>(C * V));
    gam_.resize(ck);
    zero_.assign(static_cast<size_t>(K), 0.0);
    beta_.resize(static_cast<size_t>(C));
    dbeta_.resize(static_cast<size_t>(C));
    egC_.resize(static_cast<size_t>(K));
    dgamC_.resize(static_cast<size_t>(K));
    dSn_.resize(static_cast<size_t>(K * V));
    int64_t col_rows = 0;  // Σ over sub-chunks of the rows before them
    for (int64_t r = 0; r < nsub; ++r) col_rows += r * kSubChunk;
    coldec_.resize(static_cast<size_t>(std::max<int64_t>(col_rows, 1) * K));
    kcol_.resize(coldec_.size());
    kcol_t_.resize(coldec_.size());
    kdcol_t_.resize(ck);
    col_off_.resize(static_cast<size_t>(nsub));
    diag_reference_.resize(static_cast<size_t>(nsub));
    pairdec_.resize(static_cast<size_t>(nsub * tri(kSubChunk) * K));
    int64_t widest = std::max({C, K, V});
    pack_.resize(static_cast<size_t>(widest * widest));
  }

  // Loads rows [t0, t0 + L) of a task and computes γ, the decay factors, E (= A^kk
  // without β), A^qk, M = (I + A^kk)^{-1}, Tm = M Diag(β) and W = Tm (K ⊙ e^γ).
  void prepare(const TaskRows<T>& rows, int64_t t0, int64_t L, T scale) {
    const int64_t K = K_, V = V_;
    L_ = L;
    for (int64_t i = 0; i < L; ++i) {
      const T* q = rows.q.at(t0 + i);
      const T* k = rows.k.at(t0 + i);
      const T* v = rows.v.at(t0 + i);
      const T* g = rows.g.at(t0 + i);
      for (int64_t d = 0; d < K; ++d) q_[i * K + d] = scale * q[d];
      std::copy(k, k + K, &k_[i * K]);
      std::copy(v, v + V, &v_[i * V]);
      const double* prev = i == 0 ? zero_.data() : &gam_[(i - 1) * K];
      double* gam = &gam_[i * K];
      for (int64_t d = 0; d < K; ++d) gam[d] = prev[d] + static_cast<double>(g[d]);
      beta_[i] = *rows.beta.at(t0 + i);
    }
    const double* gamC = &gam_[(L - 1) * K];
    const double* zero = zero_.data();
    exp_of_difference(egC_.data(), gamC, zero, K);
    int64_t off = 0, last0 = 0;  // last0: first row of the last sub-chunk
    for (int64_t r = 0; r * kSubChunk < L; ++r) {
      int64_t r0 = r * kSubChunk, r1 = std::min(L, r0 + kSubChunk);
      const double* gn = &gam_[r0 * K];
      last0 = r0;
      const double* gm = &gam_[(r0 + (r1 - r0) / 2) * K];
      // Every |γ_i - γ_m| <= kReferenceSpan, as a count (a max over doubles would not vectorise).
      int64_t beyond = 0;
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t d = 0; d < K; ++d) beyond += std::abs(gam_[i * K + d] - gm[d]) > kReferenceSpan;
      diag_reference_[r] = beyond == 0;
      if (diag_reference_[r]) {
        // One exp row per row: e^{γ_i - γ_m}; e^{γ_m - γ_i} is its reciprocal and e^{γ_i - γ_n}
        // = e^{γ_i - γ_m} e^{γ_m - γ_n}, all factors within e^±40 (the span just checked).
        for (int64_t i = r0; i < r1; ++i) exp_of_difference(&drow_[i * K], &gam_[i * K], gm, K);
        int64_t n = (r1 - r0) * K, x = r0 * K;
        reciprocal(&dcol_[x], &drow_[x], n);
        std::fill(&rowdec_[x], &rowdec_[x + K], T(1));  // e^{γ_n - γ_n}
        for (int64_t i = r0 + 1; i < r1; ++i) multiply(&rowdec_[i * K], &drow_[i * K], &dcol_[x], K);
        multiply(&qdiag_[x], &q_[x], &drow_[x], n);
        multiply(&kdiag_[x], &k_[x], &drow_[x], n);
        multiply(&kdcol_[x], &k_[x], &dcol_[x], n);
      } else {
        for (int64_t i = r0; i < r1; ++i) exp_of_difference(&rowdec_[i * K], &gam_[i * K], gn, K);
        T* pd = &pairdec_[r * tri(kSubChunk) * K];
        for (int64_t i = r0; i < r1; ++i)
          for (int64_t j = r0; j <= i; ++j, pd += K) exp_of_difference(pd, &gam_[i * K], &gam_[j * K], K);
      }
      // e^{γ_i} = e^{γ_n} e^{γ_i - γ_n}: one exp row per sub-chunk, both factors <= 1.
      exp_of_difference(&eg_[r0 * K], gn, zero, K);
      for (int64_t i = r0 + 1; i < r1; ++i) multiply(&eg_[i * K], &eg_[r0 * K], &rowdec_[i * K], K);
      multiply(&qrow_[r0 * K], &q_[r0 * K], &rowdec_[r0 * K], (r1 - r0) * K);
      multiply(&krow_[r0 * K], &k_[r0 * K], &rowdec_[r0 * K], (r1 - r0) * K);
      // Column factors e^{γ_n - γ_j}, j < n: the previous sub-chunk's rows (from p = n - 16) by
      // exp, the rows before p as e^{γ_n - γ_p} e^{γ_p - γ_j} (the previous sub-chunk's column
      // factors; both <= 1): 16 exp rows per sub-chunk instead of n.
      col_off_[r] = off;
      if (r0 > 0) {
        int64_t p0 = r0 - kSubChunk;
        for (int64_t j = p0; j < r0; ++j) exp_of_difference(&coldec_[off + j * K], gn, &gam_[j * K], K);
        const T* prev = &coldec_[col_off_[r - 1]];
        for (int64_t j = 0; j < p0; ++j) multiply(&coldec_[off + j * K], &coldec_[off + p0 * K], &prev[j * K], K);
      }
      multiply(&kcol_[off], k_.data(), &coldec_[off], r0 * K);
      off += r0 * K;
    }
    // e^{γ_C - γ_j}: rows of the last sub-chunk directly; earlier rows, with n = last0,
    // as e^{γ_C - γ_n} e^{γ_n - γ_j} (the last sub-chunk's column factors; both <= 1).
    for (int64_t i = last0; i < L; ++i) exp_of_difference(&eh_[i * K], gamC, &gam_[i * K], K);
    const T* last_col = &coldec_[col_off_[last0 / kSubChunk]];
    for (int64_t j = 0; j < last0; ++j) multiply(&eh_[j * K], &eh_[last0 * K], &last_col[j * K], K);
    multiply(qg_.data(), q_.data(), eg_.data(), L * K);
    multiply(kg_.data(), k_.data(), eg_.data(), L * K);
    multiply(kh_.data(), k_.data(), eh_.data(), L * K);
    // The column operands of both decayed products (E and A^qk), transposed once for both.
    for (int64_t r = 0; r * kSubChunk < L; ++r) {
      int64_t r0 = r * kSubChunk, rl = std::min(L, r0 + kSubChunk) - r0;
      if (r0 > 0 && tile_gemm_takes<T, Bytes>(r0, K))
        pack_transposed<T, Bytes>(&kcol_[col_off_[r]], K, r0, K, &kcol_t_[col_off_[r]]);
      if (diag_reference_[r] && tile_gemm_takes<T, Bytes>(rl, K))
        pack_transposed<T, Bytes>(&kdcol_[r0 * K], K, rl, K, &kdcol_t_[r0 * K]);
    }
    decayed_products(E_.data(), krow_.data(), kdiag_.data(), k_.data(), /*diagonal=*/false);
    decayed_products(Aqk_.data(), qrow_.data(), qdiag_.data(), q_.data(), /*diagonal=*/true);

    // M = (I + A^kk)^{-1} by forward substitution: M[i,:] = e_i - Σ_{m<i} A^kk[i,m] M[m,:].
    std::fill(M_.begin(), M_.begin() + L * L, T(0));
    invert_unit_lower();
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < L; ++j) Tm_[i * L + j] = M_[i * L + j] * beta_[j];
    mm(false, false, L, K, L, T(1), Tm_.data(), L, kg_.data(), K, T(0), W_.data(), K, Tri::a_lower);
  }

  // With entry state S [K, V]: writes the chunk's output rows O (row stride ldo) and advances S to S_{n+1}.
  void forward(T* S, T* o, int64_t ldo) {
    const int64_t L = L_, K = K_, V = V_;
    new_values(S);
    mm(false, false, L, V, K, T(1), qg_.data(), K, S, V, T(0), o, ldo);            // (Q̄ ⊙ e^γ) S_n
    mm(false, false, L, V, L, T(1), Aqk_.data(), L, Vn_.data(), V, T(1), o, ldo, Tri::a_lower);  // + A^qk V^new
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = 0; j < V; ++j) S[d * V + j] *= egC_[d];
    mm(true, false, K, V, L, T(1), kh_.data(), K, Vn_.data(), V, T(1), S, V);  // + (K ⊙ e^{γ_C-γ})^T V^new
  }

  // docs/model.md#kda-chunked-backward for this chunk. S: the entry state S_n; dS: in dS_{n+1}, out dS_n; dO: rows
  // of the output gradient. Writes the chunk's rows of dq (per value head), dk, dv, dg and dβ.
  void backward(const T* S, T* dS, const T* dO, int64_t ldo, Rows<T> dq, Rows<T> dk, Rows<T> dv, Rows<T> dg,
                Rows<T> dbeta, int64_t t0, T scale) {
    const int64_t L = L_, K = K_, V = V_;
    new_values(S);
    // dV^new = A^qk^T dO + (K ⊙ e^{γ_C-γ}) dS
    mm(true, false, L, V, L, T(1), Aqk_.data(), L, dO, ldo, T(0), dVn_.data(), V, Tri::a_upper);
    mm(false, false, L, V, K, T(1), kh_.data(), K, dS, V, T(1), dVn_.data(), V);
    // dA^qk = Tril(dO V^new^T)
    mm(false, true, L, L, V, T(1), dO, ldo, Vn_.data(), V, T(0), dAqk_.data(), L, Tri::c_lower);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = i + 1; j < L; ++j) dAqk_[i * L + j] = T(0);
    // dS_n = Diag(e^{γ_C}) dS + (Q̄ ⊙ e^γ)^T dO - W^T dV^new
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = 0; j < V; ++j) dSn_[d * V + j] = egC_[d] * dS[d * V + j];
    mm(true, false, K, V, L, T(1), qg_.data(), K, dO, ldo, T(1), dSn_.data(), V);
    mm(true, false, K, V, L, T(-1), W_.data(), K, dVn_.data(), V, T(1), dSn_.data(), V);
    // dU = dV^new, dW = -dV^new S_n^T; dTm = dU V^T + dW (K ⊙ e^γ)^T; dV = Tm^T dU; d(K ⊙ e^γ) = Tm^T dW
    mm(false, true, L, K, V, T(-1), dVn_.data(), V, S, V, T(0), dW_.data(), K);
    mm(false, true, L, L, V, T(1), dVn_.data(), V, v_.data(), V, T(0), dTm_.data(), L, Tri::c_lower);
    mm(false, true, L, L, K, T(1), dW_.data(), K, kg_.data(), K, T(1), dTm_.data(), L, Tri::c_lower);
    mm(true, false, L, V, L, T(1), Tm_.data(), L, dVn_.data(), V, T(0), dv.at(t0), dv.stride, Tri::a_upper);
    // dM = dTm Diag(β) and dβ_j += Σ_i dTm[i,j] M[i,j], on the lower triangle (M is lower triangular).
    std::fill(dbeta_.begin(), dbeta_.begin() + L, T(0));
    for (int64_t i = 0; i < L; ++i) {
      const T *x = &dTm_[i * L], *m = &M_[i * L];
      T* dm = &dM_[i * L];
      for (int64_t j = 0; j <= i; ++j) {
        dm[j] = x[j] * beta_[j];
        dbeta_[j] += x[j] * m[j];
      }
      std::fill(dm + i + 1, dm + L, T(0));
    }
    // dA^kk = -StrictTril(M^T dM M^T); with A^kk = Diag(β) E: dβ_i += Σ_j dA^kk[i,j] E[i,j], dE = Diag(β) dA^kk.
    mm(true, false, L, L, L, T(1), M_.data(), L, dM_.data(), L, T(0), tmpc_.data(), L, Tri::a_upper);
    mm(false, true, L, L, L, T(-1), tmpc_.data(), L, M_.data(), L, T(0), dAkk_.data(), L, Tri::c_lower);
    for (int64_t i = 0; i < L; ++i) {
      T* x = &dAkk_[i * L];
      const T* e = &E_[i * L];
      T acc = T(0);
      for (int64_t j = 0; j < i; ++j) {
        acc += x[j] * e[j];
        x[j] *= beta_[i];
      }
      dbeta_[i] += acc;
      std::fill(x + i, x + L, T(0));
    }
    // dq̄, dk and dγ from here on, in three accumulators for q̄ and k: every term of dq̄ enters
    // dγ as +q̄ ⊙ term, a term of dk as +k ⊙ term (dk_plus_) or as -k ⊙ term (dk_minus_,
    // dkh_), so dγ is formed once, in the write-out, instead of by a pass per term. Each
    // decayed-factor product writes its term through tile_gemm's factor F (no temporaries):
    // dq̄ = (dO S_n^T) ⊙ e^γ (Q̄ ⊙ e^γ), dk_plus = (Tm^T dW) ⊙ e^γ (K ⊙ e^γ), dkh = (V^new dS^T) ⊙ e^{γ_C-γ}.
    mm(false, true, L, K, V, T(1), dO, ldo, S, V, T(0), dq_.data(), K, Tri::none, eg_.data());
    mm(true, false, L, K, L, T(1), Tm_.data(), L, dW_.data(), K, T(0), dk_plus_.data(), K, Tri::a_upper, eg_.data());
    mm(false, true, L, K, V, T(1), Vn_.data(), V, dS, V, T(0), dkh_.data(), K, Tri::none, eh_.data());
    std::fill(dk_minus_.begin(), dk_minus_.begin() + L * K, T(0));
    decayed_products_backward(dAkk_.data(), krow_.data(), kdiag_.data(), k_.data(), dk_plus_.data());  // E:    x = k
    decayed_products_backward(dAqk_.data(), qrow_.data(), qdiag_.data(), q_.data(), dq_.data());       // A^qk: x = q̄
    // dγ_C = e^{γ_C} ⊙ rowsum(dS ⊙ S_n) + Σ_i k_i ⊙ dkh_i (K ⊙ e^{γ_C-γ}); γ_C is γ of the last row.
    std::fill(dgamC_.begin(), dgamC_.end(), T(0));
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < K; ++d) dgamC_[d] += k_[i * K + d] * dkh_[i * K + d];
    for (int64_t d = 0; d < K; ++d) {
      T acc = T(0);
      for (int64_t j = 0; j < V; ++j) acc += dS[d * V + j] * S[d * V + j];
      dgamC_[d] += egC_[d] * acc;
    }
    // Write out, rows from the last: dγ_i, dg_i = Σ_{l >= i} dγ_l (a running sum per channel,
    // started at dγ_C), dq = scale dq̄, dk, dβ. The gradient rows never overlap the chunk's
    // buffers; ivdep says so, else GCC keeps this loop scalar (it was 12% of the time).
    for (int64_t i = L - 1; i >= 0; --i) {
      T *gi = dg.at(t0 + i), *qi = dq.at(t0 + i), *ki = dk.at(t0 + i);
#pragma GCC ivdep
      for (int64_t d = 0; d < K; ++d) {
        int64_t x = i * K + d;
        T kp = dk_plus_[x], km = dk_minus_[x] + dkh_[x];
        dgamC_[d] += q_[x] * dq_[x] + k_[x] * (kp - km);
        gi[d] = dgamC_[d];
        qi[d] = scale * dq_[x];
        ki[d] = kp + km;
      }
      *dbeta.at(t0 + i) = dbeta_[i];
    }
    std::copy(dSn_.begin(), dSn_.end(), dS);
  }

 private:
  // M = (I + A^kk)^{-1}, A^kk = Diag(β) E strictly lower triangular, row by row:
  // M[i,:] = e_i - Σ_{m<i} A^kk[i,m] M[m,:], m ascending. Row i is kept in registers
  // (NR vectors) while the rows above are subtracted: through memory each step would
  // wait for the previous one's store. Row m of M is zero beyond column m, so the
  // whole-vector updates also subtract a·0 from entries that are still +0 (or the 1 at
  // i): the bits of a loop that stops at column m. Rows whose columns need more than
  // kMaxRowVecs vectors, or L not a multiple of the vector, take that scalar loop.
  static constexpr int kMaxRowVecs = 8;
  template <int NR>
  void invert_row(int64_t i) {
    using Vt = Vec<T, Bytes>;
    constexpr int64_t W = Bytes / sizeof(T);
    const int64_t L = L_;
    Vt acc[NR];
    T* mi = &M_[i * L];
    for (int v = 0; v < NR; ++v) load_vec(acc[v], mi + v * W);
    for (int64_t m = 0; m < i; ++m) {
      T a = beta_[i] * E_[i * L + m];
      if (a == T(0)) continue;
      const T* mm = &M_[m * L];
      for (int v = 0; v < NR; ++v) {
        Vt x;
        load_vec(x, mm + v * W);
        acc[v] -= a * x;
      }
    }
    for (int v = 0; v < NR; ++v) store_vec(mi + v * W, acc[v]);
  }
  void invert_unit_lower() {
    constexpr int64_t W = Bytes / sizeof(T);
    const int64_t L = L_;
    for (int64_t i = 0; i < L; ++i) {
      T* mi = &M_[i * L];
      mi[i] = T(1);
      const int64_t nr = i / W + 1;  // vectors covering columns 0..i
      if (L % W == 0 && nr <= kMaxRowVecs) {
        [&]<int... R>(std::integer_sequence<int, R...>) {
          ((nr == R + 1 ? invert_row<R + 1>(i) : void()), ...);
        }(std::make_integer_sequence<int, kMaxRowVecs>{});
        continue;
      }
      for (int64_t m = 0; m < i; ++m) {
        T a = beta_[i] * E_[i * L + m];
        if (a == T(0)) continue;
        const T* mm = &M_[m * L];
        for (int64_t j = 0; j <= m; ++j) mi[j] -= a * mm[j];
      }
    }
  }

  // V^new = U - W S_n with U = Tm V.
  void new_values(const T* S) {
    const int64_t L = L_, K = K_, V = V_;
    mm(false, false, L, V, L, T(1), Tm_.data(), L, v_.data(), V, T(0), Vn_.data(), V, Tri::a_lower);
    mm(false, false, L, V, K, T(-1), W_.data(), K, S, V, T(1), Vn_.data(), V);
  }

  // P[i,j] = Σ_d x_{i,d} k_{j,d} exp(γ_{i,d} - γ_{j,d}) for j < i (and j = i when `diagonal`),
  // zero above. xrow = x ⊙ exp(γ - γ_n) with n the first row of each row's sub-chunk;
  // xdiag = x ⊙ exp(γ - γ_m) with m the middle row (sub-chunks with diag_reference_).
  void decayed_products(T* P, const T* xrow, const T* xdiag, const T* x, bool diagonal) {
    const int64_t L = L_, K = K_;
    std::fill(P, P + L * L, T(0));
    for (int64_t r = 0; r * kSubChunk < L; ++r) {
      int64_t r0 = r * kSubChunk, r1 = std::min(L, r0 + kSubChunk), rl = r1 - r0;
      // Off-diagonal block [r0, r1) x [0, r0): one matmul of reference-scaled rows.
      // (Each as tile_gemm would multiply it, with the transpose packed in prepare(): the same bits.)
      if (tile_gemm_takes<T, Bytes>(r0, K))
        mm(false, false, rl, r0, K, T(1), xrow + r0 * K, K, &kcol_t_[col_off_[r]], r0, T(0), P + r0 * L, L);
      else
        mm(false, true, rl, r0, K, T(1), xrow + r0 * K, K, &kcol_[col_off_[r]], K, T(0), P + r0 * L, L);
      if (diag_reference_[r]) {
        // Diagonal block as a matmul; the entries above the diagonal (factors > 1, unused) are zeroed.
        if (tile_gemm_takes<T, Bytes>(rl, K))
          mm(false, false, rl, rl, K, T(1), xdiag + r0 * K, K, &kdcol_t_[r0 * K], rl, T(0), P + r0 * L + r0, L);
        else
          mm(false, true, rl, rl, K, T(1), xdiag + r0 * K, K, &kdcol_[r0 * K], K, T(0), P + r0 * L + r0, L);
        for (int64_t i = r0; i < r1; ++i)
          for (int64_t j = diagonal ? i + 1 : i; j < r1; ++j) P[i * L + j] = T(0);
        continue;
      }
      const T* pd = &pairdec_[r * tri(kSubChunk) * K];
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = r0; j <= i; ++j, pd += K) {
          if (j == i && !diagonal) continue;
          const T* xi = x + i * K;
          const T* kj = &k_[j * K];
          T acc = T(0);
          for (int64_t d = 0; d < K; ++d) acc += xi[d] * kj[d] * pd[d];
          P[i * L + j] = acc;
        }
    }
  }

  // Backward of decayed_products for dP (zero where P is structurally zero):
  // dx_i += Σ_j dP_ij e^{γ_i-γ_j} ⊙ k_j, dk_j += Σ_i dP_ij e^{γ_i-γ_j} ⊙ x_i. dγ_i gains
  // x_i ⊙ (the dx_i term) and dγ_j loses k_j ⊙ (the dk_j term): backward() forms dγ from dx
  // and dk_minus_, so the dx terms go into dx, the dk terms into dk_minus_, each product
  // scaled by its decay factors in tile_gemm (F) and added in place.
  void decayed_products_backward(const T* dP, const T* xrow, const T* xdiag, const T* x, T* dx) {
    const int64_t L = L_, K = K_;
    T* dkm = dk_minus_.data();
    for (int64_t r = 0; r * kSubChunk < L; ++r) {
      int64_t r0 = r * kSubChunk, r1 = std::min(L, r0 + kSubChunk), rl = r1 - r0;
      if (r0 > 0) {
        const T *col = &coldec_[col_off_[r]], *kcol = &kcol_[col_off_[r]];
        mm(false, false, rl, K, r0, T(1), dP + r0 * L, L, kcol, K, T(1), dx + r0 * K, K, Tri::none, &rowdec_[r0 * K]);
        mm(true, false, r0, K, rl, T(1), dP + r0 * L, L, xrow + r0 * K, K, T(1), dkm, K, Tri::none, col);
      }
      if (diag_reference_[r]) {
        const T* dPd = dP + r0 * L + r0;  // [rl, rl], lower triangular
        mm(false, false, rl, K, rl, T(1), dPd, L, &kdcol_[r0 * K], K, T(1), dx + r0 * K, K, Tri::a_lower,
           &drow_[r0 * K]);
        mm(true, false, rl, K, rl, T(1), dPd, L, xdiag + r0 * K, K, T(1), dkm + r0 * K, K, Tri::a_upper,
           &dcol_[r0 * K]);
        continue;
      }
      const T* pd = &pairdec_[r * tri(kSubChunk) * K];
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = r0; j <= i; ++j, pd += K) {
          T p = dP[i * L + j];
          if (p == T(0)) continue;
          const T* xi = x + i * K;
          const T* kj = &k_[j * K];
          T* dxi = dx + i * K;
          T* dkj = dkm + j * K;
          for (int64_t d = 0; d < K; ++d) {
            T e = p * pd[d];
            dxi[d] += e * kj[d];
            dkj[d] += e * xi[d];
          }
        }
    }
  }

  void mm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc, Tri tri = Tri::none, const T* f = nullptr) {
    tile_gemm<T, Bytes>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, pack_.data(), tri, f);
  }

  int64_t C_, K_, V_, L_ = 0;
  std::vector<T> pack_;  // B^T for tile_gemm
  std::vector<T> q_, k_, v_, beta_;      // chunk rows; q_ = scale q
  std::vector<double> gam_;              // [L, K] γ, inclusive within-chunk cumsum of g
  std::vector<double> zero_;             // [K] zeros
  std::vector<T> eg_, eh_, egC_;         // e^γ, e^{γ_C - γ}, e^{γ_C}
  std::vector<T> qg_, kg_, kh_;          // q̄ ⊙ e^γ, k ⊙ e^γ, k ⊙ e^{γ_C - γ}
  std::vector<T> rowdec_, qrow_, krow_;  // e^{γ_i - γ_n} (n: first row of i's sub-chunk), q̄ and k scaled by it
  std::vector<T> coldec_, kcol_;         // per sub-chunk r, rows j < n_r: e^{γ_n - γ_j} and k scaled by it
  std::vector<T> kcol_t_, kdcol_t_;      // kcol_ and kdcol_ per sub-chunk, transposed ([K, rows])
  std::vector<int64_t> col_off_;         // offset of sub-chunk r in coldec_/kcol_
  std::vector<bool> diag_reference_;     // per sub-chunk: diagonal block by the middle-row reference
  std::vector<T> drow_, dcol_, qdiag_, kdiag_, kdcol_;  // e^{γ_i - γ_m}, e^{γ_m - γ_i}, q̄ ⊙ drow, k ⊙ drow, k ⊙ dcol
  std::vector<T> pairdec_;                              // other sub-chunks, pairs j <= i inside it: e^{γ_i - γ_j}
  std::vector<T> E_, Aqk_, M_, Tm_, W_, Vn_;
  // backward
  std::vector<T> dVn_, dAqk_, dSn_, dW_, dTm_, dM_, dAkk_, tmpc_, dgamC_, dbeta_;
  std::vector<T> dq_, dk_plus_, dk_minus_, dkh_;  // [L, K] dq̄ and dk in parts (backward())
};


// ---------------------------------------------------------------------------------------------------
// Chunked entry points: the arguments, one thread's share of tasks [lo, hi), and that
// share compiled twice: portable (the build's baseline ISA) and, on x86-64 CPUs with
// AVX2 and FMA, with those enabled. The AVX2 copy is the same source: gnu::flatten
// inlines the whole task loop (KdaChunk, exp_approx, the elementwise loops) into a
// function compiled for avx2,fma, so the compiler vectorises it 8 (f32) / 4 (f64)
// wide and contracts a*b+c into FMAs. OpenBLAS picks its own kernels at run time.
// The two copies round differently (FMA); each is deterministic.

template <class T>
struct ChunkedForward {
  Dims d;
  int64_t C;
  T scale;
  Tensor *o, *state, *chunk_states;
  const Tensor *q, *k, *v, *g, *beta;
};

template <class T>
struct ChunkedBackward {
  Dims d;
  int64_t C;
  T scale;
  Tensor *dq, *dk, *dv, *dg, *dbeta, *dh0;  // dq, dk: per value head [B, T, HV, K]
  const Tensor *grad_o, *grad_final_state, *q, *k, *v, *g, *beta, *chunk_states;
};

template <class T, int Bytes>
void chunked_forward_tasks(const ChunkedForward<T>& a, int64_t lo, int64_t hi) {
  const Dims& d = a.d;
  const int64_t KV = d.K * d.V, C = a.C, N = kda_num_segments(d.T, C);
  T* cs = a.chunk_states ? a.chunk_states->template data<T>() : nullptr;
  KdaChunk<T, Bytes> chunk(C, d.K, d.V);
  for (int64_t task = lo; task < hi; ++task) {
    TaskRows<T> rows = task_rows<T>(d, task, *a.q, *a.k, *a.v, *a.g, *a.beta);
    Rows<T> out = v_rows(a.o->template data<T>(), d, task);
    T* S = a.state->template data<T>() + task * KV;
    for (int64_t n = 0; n < N; ++n) {
      int64_t t0 = n * C, L = std::min(C, d.T - t0);
      if (cs) std::copy(S, S + KV, cs + (task * N + n) * KV);
      chunk.prepare(rows, t0, L, a.scale);
      chunk.forward(S, out.at(t0), out.stride);
    }
  }
}

template <class T, int Bytes>
void chunked_backward_tasks(const ChunkedBackward<T>& a, int64_t lo, int64_t hi) {
  const Dims& d = a.d;
  const int64_t KV = d.K * d.V, C = a.C, N = kda_num_segments(d.T, C);
  const T* cs = a.chunk_states->template data<T>();
  KdaChunk<T, Bytes> chunk(C, d.K, d.V);
  std::vector<T> dS(static_cast<size_t>(KV));
  for (int64_t task = lo; task < hi; ++task) {
    TaskRows<T> rows = task_rows<T>(d, task, *a.q, *a.k, *a.v, *a.g, *a.beta);
    Rows<T> go = v_rows(a.grad_o->template data<T>(), d, task), dv = v_rows(a.dv->template data<T>(), d, task);
    Rows<T> dq = gk_rows(a.dq->template data<T>(), d, task), dk = gk_rows(a.dk->template data<T>(), d, task);
    Rows<T> dg = gk_rows(a.dg->template data<T>(), d, task), db = beta_rows(a.dbeta->template data<T>(), d, task);
    const T* dST = a.grad_final_state->template data<T>() + task * KV;
    std::copy(dST, dST + KV, dS.begin());
    for (int64_t n = N - 1; n >= 0; --n) {
      int64_t t0 = n * C, L = std::min(C, d.T - t0);
      chunk.prepare(rows, t0, L, a.scale);
      chunk.backward(cs + (task * N + n) * KV, dS.data(), go.at(t0), go.stride, dq, dk, dv, dg, db, t0, a.scale);
    }
    std::copy(dS.begin(), dS.end(), a.dh0->template data<T>() + task * KV);
  }
}

std::atomic<int> g_forced_isa{-1};  // kda_chunked_force_isa; -1: vector_isa()

#if defined(__x86_64__) && defined(__GNUC__)
[[MT_TARGET_AVX2]] void chunked_tasks_avx2(const ChunkedForward<float>& a, int64_t lo, int64_t hi) {
  chunked_forward_tasks<float, 32>(a, lo, hi);
}
[[MT_TARGET_AVX2]] void chunked_tasks_avx2(const ChunkedForward<double>& a, int64_t lo, int64_t hi) {
  chunked_forward_tasks<double, 32>(a, lo, hi);
}
[[MT_TARGET_AVX2]] void chunked_tasks_avx2(const ChunkedBackward<float>& a, int64_t lo, int64_t hi) {
  chunked_backward_tasks<float, 32>(a, lo, hi);
}
[[MT_TARGET_AVX2]] void chunked_tasks_avx2(const ChunkedBackward<double>& a, int64_t lo, int64_t hi) {
  chunked_backward_tasks<double, 32>(a, lo, hi);
}
[[MT_TARGET_AVX512]] void chunked_tasks_avx512(const ChunkedForward<float>& a, int64_t lo, int64_t hi) {
  chunked_forward_tasks<float, 64>(a, lo, hi);
}
[[MT_TARGET_AVX512]] void chunked_tasks_avx512(const ChunkedForward<double>& a, int64_t lo, int64_t hi) {
  chunked_forward_tasks<double, 64>(a, lo, hi);
}
[[MT_TARGET_AVX512]] void chunked_tasks_avx512(const ChunkedBackward<float>& a, int64_t lo, int64_t hi) {
  chunked_backward_tasks<float, 64>(a, lo, hi);
}
[[MT_TARGET_AVX512]] void chunked_tasks_avx512(const ChunkedBackward<double>& a, int64_t lo, int64_t hi) {
  chunked_backward_tasks<double, 64>(a, lo, hi);
}
#else
template <class A>
void chunked_tasks_avx2(const A&, int64_t, int64_t) {}
template <class A>
void chunked_tasks_avx512(const A&, int64_t, int64_t) {}
#endif

VectorIsa chunked_isa() {
  int forced = g_forced_isa.load();
  VectorIsa isa = vector_isa();
  return forced < 0 ? isa : std::min(isa, static_cast<VectorIsa>(forced));
}

template <class T>
void run_chunked(const ChunkedForward<T>& a, int64_t lo, int64_t hi) {
  switch (chunked_isa()) {
    case VectorIsa::avx512:
      return chunked_tasks_avx512(a, lo, hi);
    case VectorIsa::avx2:
      return chunked_tasks_avx2(a, lo, hi);
    case VectorIsa::generic:
      return chunked_forward_tasks<T, 32>(a, lo, hi);
  }
}
template <class T>
void run_chunked(const ChunkedBackward<T>& a, int64_t lo, int64_t hi) {
  switch (chunked_isa()) {
    case VectorIsa::avx512:
      return chunked_tasks_avx512(a, lo, hi);
    case VectorIsa::avx2:
      return chunked_tasks_avx2(a, lo, hi);
    case VectorIsa::generic:
      return chunked_backward_tasks<T, 32>(a, lo, hi);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------

void kda_recurrent_forward(Tensor& o, Tensor& state, Tensor* checkpoints, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& g, const Tensor& beta, double scale) {
  dispatch_float(q.dtype(), "kda_recurrent", [&](auto tag) {
    using T = decltype(tag);
    Dims d(q, v);
    const int64_t KV = d.K * d.V, R = kKdaRecurrentSegment, nseg = kda_num_segments(d.T, R);
    T* cp = checkpoints ? checkpoints->data<T>() : nullptr;
    parallel_for(d.tasks(), 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> delta(static_cast<size_t>(d.V));
      for (int64_t task = lo; task < hi; ++task) {
        TaskRows<T> rows = task_rows<T>(d, task, q, k, v, g, beta);
        Rows<T> out = v_rows(o.data<T>(), d, task);
        T* S = state.data<T>() + task * KV;
        for (int64_t t = 0; t < d.T; ++t) {
          if (cp && t % R == 0) std::copy(S, S + KV, cp + (task * nseg + t / R) * KV);
          recurrent_step(S, out.at(t), delta.data(), rows.q.at(t), rows.k.at(t), rows.v.at(t), rows.g.at(t),
                         *rows.beta.at(t), static_cast<T>(scale), d.K, d.V);
        }
      }
    });
  });
}

void kda_recurrent_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g, Tensor& grad_beta,
                            Tensor& grad_h0, const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                            const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                            const Tensor& checkpoints, double scale) {
  dispatch_float(q.dtype(), "kda_recurrent_backward", [&](auto tag) {
    using T = decltype(tag);
    Dims d(q, v);
    const int64_t K = d.K, V = d.V, KV = K * V, R = kKdaRecurrentSegment, nseg = kda_num_segments(d.T, R);
    const T sc = static_cast<T>(scale);
    QkGradTargets targets(grad_q, grad_k, d);
    const T* cp = checkpoints.data<T>();
    parallel_for(d.tasks(), 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> states(static_cast<size_t>((R + 1) * KV)), deltas(static_cast<size_t>(R * V));
      std::vector<T> dS(static_cast<size_t>(KV)), u(static_cast<size_t>(V)), rd(static_cast<size_t>(K)),
          scratch(static_cast<size_t>(V));
      for (int64_t task = lo; task < hi; ++task) {
        TaskRows<T> rows = task_rows<T>(d, task, q, k, v, g, beta);
        Rows<T> go = v_rows(grad_o.data<T>(), d, task), dv = v_rows(grad_v.data<T>(), d, task);
        Rows<T> dq = gk_rows(targets.dq.data<T>(), d, task), dk = gk_rows(targets.dk.data<T>(), d, task);
        Rows<T> dg = gk_rows(grad_g.data<T>(), d, task), db = beta_rows(grad_beta.data<T>(), d, task);
        const T* dST = grad_final_state.data<T>() + task * KV;
        std::copy(dST, dST + KV, dS.begin());
        for (int64_t s = nseg - 1; s >= 0; --s) {
          // Recompute the segment: states[i] = S before step t0 + i, deltas[i] = δ of that step.
          int64_t t0 = s * R, n = std::min(R, d.T - t0);
          std::copy(cp + (task * nseg + s) * KV, cp + (task * nseg + s + 1) * KV, states.begin());
          for (int64_t i = 0; i < n; ++i) {
            T* next = &states[(i + 1) * KV];
            std::copy(&states[i * KV], next, next);
            recurrent_step(next, scratch.data(), &deltas[i * V], rows.q.at(t0 + i), rows.k.at(t0 + i),
                           rows.v.at(t0 + i), rows.g.at(t0 + i), *rows.beta.at(t0 + i), sc, K, V);
          }
          for (int64_t i = n - 1; i >= 0; --i) {
            int64_t t = t0 + i;
            const T* St = &states[(i + 1) * KV];  // S_t
            const T* Sp = &states[i * KV];        // S_{t-1}; S'_t = Diag(α_t) S_{t-1}
            const T* delta = &deltas[i * V];
            const T *qt = rows.q.at(t), *kt = rows.k.at(t), *gt = rows.g.at(t), *dot = go.at(t);
            T bt = *rows.beta.at(t);
            // dq_t = scale S_t do_t; dS += q̄_t do_t^T; u = dS^T k_t; rd = dS δ_t; dβ_t = k_t^T dS δ_t
            T* dqt = dq.at(t);
            T dbeta = T(0);
            std::fill(u.begin(), u.end(), T(0));
            for (int64_t c = 0; c < K; ++c) {
              const T* srow = St + c * V;
              T* dsrow = &dS[c * V];
              T acc = T(0);
              for (int64_t j = 0; j < V; ++j) acc += srow[j] * dot[j];
              dqt[c] = sc * acc;
              T qc = sc * qt[c], kc = kt[c], r = T(0);
              for (int64_t j = 0; j < V; ++j) {
                dsrow[j] += qc * dot[j];
                u[j] += kc * dsrow[j];
                r += dsrow[j] * delta[j];
              }
              rd[c] = r;
              dbeta += kc * r;
            }
            // dδ = β dS^T k_t (= dv_t)
            T* ddelta = dv.at(t);
            for (int64_t j = 0; j < V; ++j) ddelta[j] = bt * u[j];
            // dk_t = β dS δ_t - S'_t dδ; dS' = dS - k_t dδ^T; dg_t = rowsum(dS' ⊙ S'_t); dS = Diag(α_t) dS'
            T* dkt = dk.at(t);
            T* dgt = dg.at(t);
            for (int64_t c = 0; c < K; ++c) {
              T a = exp_of(gt[c]), kc = kt[c], sd = T(0), gg = T(0);
              const T* sprow = Sp + c * V;
              T* dsrow = &dS[c * V];
              for (int64_t j = 0; j < V; ++j) {
                T sp = sprow[j] * a;
                sd += sp * ddelta[j];
                T dsp = dsrow[j] - kc * ddelta[j];
                gg += dsp * sp;
                dsrow[j] = a * dsp;
              }
              dkt[c] = bt * rd[c] - sd;
              dgt[c] = gg;
            }
            *db.at(t) = dbeta;
          }
        }
        std::copy(dS.begin(), dS.end(), grad_h0.data<T>() + task * KV);
      }
    });
    targets.template finish<T>(grad_q, grad_k, d);
  });
}

void kda_chunked_forward(Tensor& o, Tensor& state, Tensor* chunk_states, const Tensor& q, const Tensor& k,
                         const Tensor& v, const Tensor& g, const Tensor& beta, double scale, int64_t chunk_size) {
  dispatch_float(q.dtype(), "kda_chunked", [&](auto tag) {
    using T = decltype(tag);
    ChunkedForward<T> a{Dims(q, v), chunk_size, static_cast<T>(scale), &o, &state, chunk_states, &q, &k, &v, &g, &beta};
    parallel_for(a.d.tasks(), 1, [&](int64_t lo, int64_t hi) { run_chunked(a, lo, hi); });
  });
}

void kda_chunked_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g, Tensor& grad_beta,
                          Tensor& grad_h0, const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& chunk_states, double scale, int64_t chunk_size) {
  dispatch_float(q.dtype(), "kda_chunked_backward", [&](auto tag) {
    using T = decltype(tag);
    Dims d(q, v);
    QkGradTargets targets(grad_q, grad_k, d);
    ChunkedBackward<T> a{d,          chunk_size, static_cast<T>(scale), &targets.dq, &targets.dk, &grad_v, &grad_g,
                         &grad_beta, &grad_h0,   &grad_o,               &grad_final_state,       &q,      &k,
                         &v,         &g,         &beta,                 &chunk_states};
    parallel_for(d.tasks(), 1, [&](int64_t lo, int64_t hi) { run_chunked(a, lo, hi); });
    targets.template finish<T>(grad_q, grad_k, d);
  });
}

VectorIsa kda_chunked_isa() { return chunked_isa(); }
void kda_chunked_force_isa(VectorIsa cap) { g_forced_isa.store(static_cast<int>(cap)); }
void kda_chunked_unforce_isa() { g_forced_isa.store(-1); }

}  // namespace moetrain::cpu
