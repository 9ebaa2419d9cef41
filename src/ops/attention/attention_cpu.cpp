// Tiled causal attention on the CPU. Work item = (batch, head, query tile) in
// forward and (batch, head) in backward, where dK and dV accumulate over the
// tiles of one head in order; all matrix work is BLAS (single-threaded inside
// our parallel region). Scores and probabilities live in a per-thread buffer.
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/attention/attention_kernels.h"
#include "ops/common/math.h"

namespace moetrain::cpu {

namespace {

// T = query rows, Tk = key rows; query row t sits at absolute position off + t
// (off = Tk - T: 0 in training, the cache length when decoding).
struct Dims {
  int64_t B, T, Tk, off, H, Dk, Dv, tiles;
};

Dims dims_of(const Tensor& q, const Tensor& k, const Tensor& v) {
  Dims d{q.size(0), q.size(1), k.size(1), k.size(1) - q.size(1), q.size(2), q.size(3), v.size(3), 0};
  d.tiles = (d.T + kAttentionTile - 1) / kAttentionTile;
  return d;
}

// P[i, s] = exp(S[i, s] - lse_row(i)) for s ≤ first_pos + i, else 0. With `lse`
// null the row log-sum-exp is computed (forward: the row max, then Σ e^{S - max} in
// double over kLanes lanes, ops/common/math.h) and written to lse_out, and the row
// max to max_out when that is non-null (QK-Clip's statistic). Runs in the
// cpu::vector_isa() copy (run_vector_isa), so the exponentials are 16 or 8 wide.
template <class T>
inline void probabilities_rows(T* __restrict S, int64_t tq, int64_t first_pos, int64_t width, const T* lse,
                               T* lse_out, T* max_out) {
  for (int64_t i = 0; i < tq; ++i) {
    T* row = S + i * width;
    const int64_t valid = first_pos + i + 1;
    T l;
    if (lse) {
      l = lse[i];
    } else {
      const T m = max_of(row, valid);
      l = static_cast<T>(static_cast<double>(m) + std::log(sum_exp(row, valid, m)));
      lse_out[i] = l;
      if (max_out) max_out[i] = m;
    }
    for (int64_t s = 0; s < valid; ++s) row[s] = exp_of(row[s] - l);
    for (int64_t s = valid; s < width; ++s) row[s] = T(0);
  }
}
template <class T>
void probabilities(T* S, int64_t tq, int64_t first_pos, int64_t width, const T* lse, T* lse_out,
                   T* max_out = nullptr) {
  run_vector_isa([](auto... a) { probabilities_rows<T>(a...); }, S, tq, first_pos, width, lse, lse_out, max_out);
}

// dS = P ⊙ (dP - D_row) over a tile [tq, width], in place in dP.
template <class T>
inline void softmax_grad_rows(T* __restrict dS, const T* __restrict P, const T* __restrict D, int64_t tq,
                              int64_t width) {
  for (int64_t i = 0; i < tq; ++i)
    for (int64_t c = 0; c < width; ++c) dS[i * width + c] = P[i * width + c] * (dS[i * width + c] - D[i]);
}

}  // namespace

void causal_attention_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                              double scale, Tensor* row_max) {
  dispatch_float(q.dtype(), "causal_attention", [&](auto tag) {
    using T = decltype(tag);
    Dims d = dims_of(q, k, v);
    const T* pq = q.data<T>();
    const T* pk = k.data<T>();
    const T* pv = v.data<T>();
    T* po = o.data<T>();
    T* pl = lse.data<T>();
    T* pm = row_max ? row_max->data<T>() : nullptr;
    int64_t ldk = d.H * d.Dk, ldv = d.H * d.Dv;
    parallel_for(d.B * d.H * d.tiles, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> S(static_cast<size_t>(kAttentionTile * d.Tk));
      for (int64_t item = lo; item < hi; ++item) {
        int64_t tile = item % d.tiles, bh = item / d.tiles, b = bh / d.H, h = bh % d.H;
        int64_t r0 = tile * kAttentionTile, r1 = std::min(d.T, r0 + kAttentionTile), tq = r1 - r0;
        int64_t width = d.off + r1;  // keys visible to the tile's last row
        const T* q_tile = pq + ((b * d.T + r0) * d.H + h) * d.Dk;
        const T* k_head = pk + (b * d.Tk * d.H + h) * d.Dk;
        const T* v_head = pv + (b * d.Tk * d.H + h) * d.Dv;
        // S = scale Q_tile K[0:width]^T   [tq, width]
        gemm(false, true, tq, width, d.Dk, static_cast<T>(scale), q_tile, ldk, k_head, ldk, T(0), S.data(), width);
        probabilities<T>(S.data(), tq, d.off + r0, width, nullptr, pl + bh * d.T + r0,
                         pm ? pm + bh * d.T + r0 : nullptr);
        // O_tile = P V[0:width]   [tq, Dv]
        gemm(false, false, tq, d.Dv, width, T(1), S.data(), width, v_head, ldv, T(0),
             po + ((b * d.T + r0) * d.H + h) * d.Dv, ldv);
      }
    });
  });
}

void causal_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                               const Tensor& lse, double scale) {
  dispatch_float(q.dtype(), "causal_attention_backward", [&](auto tag) {
    using T = decltype(tag);
    Dims d = dims_of(q, k, v);
    const T* pq = q.data<T>();
    const T* pk = k.data<T>();
    const T* pv = v.data<T>();
    const T* po = o.data<T>();
    const T* pdo = grad_o.data<T>();
    const T* pl = lse.data<T>();
    T* dq = grad_q.data<T>();
    T* dk = grad_k.data<T>();
    T* dv = grad_v.data<T>();
    int64_t ldk = d.H * d.Dk, ldv = d.H * d.Dv;
    T s = static_cast<T>(scale);
    parallel_for(d.B * d.H, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> P(static_cast<size_t>(kAttentionTile * d.Tk)), dS(P.size()), D(kAttentionTile);
      for (int64_t bh = lo; bh < hi; ++bh) {
        int64_t b = bh / d.H, h = bh % d.H;
        const T* k_head = pk + (b * d.Tk * d.H + h) * d.Dk;
        const T* v_head = pv + (b * d.Tk * d.H + h) * d.Dv;
        T* dk_head = dk + (b * d.Tk * d.H + h) * d.Dk;
        T* dv_head = dv + (b * d.Tk * d.H + h) * d.Dv;
        for (int64_t tile = 0; tile < d.tiles; ++tile) {
          int64_t r0 = tile * kAttentionTile, r1 = std::min(d.T, r0 + kAttentionTile), tq = r1 - r0;
          int64_t width = d.off + r1;
          int64_t qoff = ((b * d.T + r0) * d.H + h) * d.Dk, ooff = ((b * d.T + r0) * d.H + h) * d.Dv;
          gemm(false, true, tq, width, d.Dk, s, pq + qoff, ldk, k_head, ldk, T(0), P.data(), width);
          probabilities<T>(P.data(), tq, d.off + r0, width, pl + bh * d.T + r0, nullptr);
          // dP = dO_tile V[0:width]^T   [tq, width]
          gemm(false, true, tq, width, d.Dv, T(1), pdo + ooff, ldv, v_head, ldv, T(0), dS.data(), width);
          for (int64_t i = 0; i < tq; ++i) {
            const T* gor = pdo + ooff + i * ldv;
            const T* orow = po + ooff + i * ldv;
            T acc = 0;
            for (int64_t j = 0; j < d.Dv; ++j) acc += gor[j] * orow[j];
            D[static_cast<size_t>(i)] = acc;
          }
          run_vector_isa([](auto... a) { softmax_grad_rows<T>(a...); }, dS.data(), static_cast<const T*>(P.data()),
                         static_cast<const T*>(D.data()), tq, width);
          // dQ_tile = scale dS K[0:width];  dK[0:width] += scale dS^T Q_tile;  dV[0:width] += P^T dO_tile
          gemm(false, false, tq, d.Dk, width, s, dS.data(), width, k_head, ldk, T(0), dq + qoff, ldk);
          gemm(true, false, width, d.Dk, tq, s, dS.data(), width, pq + qoff, ldk, T(1), dk_head, ldk);
          gemm(true, false, width, d.Dv, tq, T(1), P.data(), width, pdo + ooff, ldv, T(1), dv_head, ldv);
        }
      }
    });
  });
}

}  // namespace moetrain::cpu
