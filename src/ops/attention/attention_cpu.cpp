// Tiled causal attention on the CPU. Work item = (batch, head, query tile) in
// forward and (batch, head) in backward, where dK and dV accumulate over the
// tiles of one head in order; all matrix work is BLAS (single-threaded inside
// our parallel region). Scores and probabilities live in a per-thread buffer.
//
// bf16 q, k, v (train.dtype bf16): the same tiles, with the products on oneDNN's bf16
// matmul with f32 accumulation (backend/cpu/onednn.h, single-threaded inside our
// region), as FlashAttention does on a GPU: scores S, the softmax, lse and dP in f32;
// P (and scale dS) rounded to bf16 as the operands of O = P V, dV += P^T dO, dQ = dS K,
// dK += dS^T Q; dK and dV accumulate in per-thread f32 buffers over a head's tiles and
// are rounded once. Each item runs on one thread, so the bits do not depend on the
// thread count.
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/onednn.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/attention/attention_kernels.h"
#include "ops/common/bf16_rows.h"
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

// rows x cols bf16 values at row stride ld copied to (from) a dense [rows, cols] buffer.
// The products below take dense operands only: oneDNN's brgemm matmul (AMX or
// AVX512-BF16 by CPU) refuses any row stride other than the width and leaves such a
// product to its generic gemm:jit, which never uses AMX.
void pack_rows(bf16* __restrict dst, const bf16* __restrict src, int64_t rows, int64_t cols, int64_t ld) {
  const size_t bytes = static_cast<size_t>(cols) * sizeof(bf16);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * cols, src + r * ld, bytes);
}
void unpack_rows(bf16* __restrict dst, int64_t ld, const bf16* __restrict src, int64_t rows, int64_t cols) {
  const size_t bytes = static_cast<size_t>(cols) * sizeof(bf16);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ld, src + r * cols, bytes);
}

// C [m, n] (row stride ldc, dtype c_type) = op(A) op(B) (+ C when accumulate) for bf16 A
// [m, k] and B [k, n] with row strides lda, ldb as stored; f32 accumulation.
void attention_bf16_product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda,
                            const bf16* b, int64_t ldb, DType c_type, void* c, int64_t ldc, bool accumulate = false) {
  onednn::MatmulShape s;
  s.trans_a = ta, s.trans_b = tb, s.m = m, s.n = n, s.k = k, s.lda = lda, s.ldb = ldb, s.ldc = ldc;
  onednn::matmul(s, DType::bf16, a, b, c_type, c, accumulate);
}

void causal_attention_forward_bf16(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                                   double scale, Tensor* row_max) {
  MT_CHECK(k.dtype() == DType::bf16 && v.dtype() == DType::bf16 && o.dtype() == DType::bf16 &&
               lse.dtype() == DType::f32 && (!row_max || row_max->dtype() == DType::f32),
           "causal_attention: bf16 q needs bf16 k, v, o and f32 lse/row_max; got k {}, v {}, o {}, lse {}", k.dtype(),
           v.dtype(), o.dtype(), lse.dtype());
  Dims d = dims_of(q, k, v);
  const bf16* pq = q.data<bf16>();
  const bf16* pk = k.data<bf16>();
  const bf16* pv = v.data<bf16>();
  bf16* po = o.data<bf16>();
  float* pl = lse.data<float>();
  float* pm = row_max ? row_max->data<float>() : nullptr;
  const int64_t ldk = d.H * d.Dk, ldv = d.H * d.Dv;
  const float s = static_cast<float>(scale);
  parallel_for(d.B * d.H * d.tiles, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> S(static_cast<size_t>(kAttentionTile * d.Tk));
    std::vector<bf16> P(S.size());
    // Dense copies of the item's operands (pack_rows): Q's tile, K and V up to the tile's
    // last key, and O's tile before it is written out.
    std::vector<bf16> qd(static_cast<size_t>(kAttentionTile * d.Dk)), od(static_cast<size_t>(kAttentionTile * d.Dv));
    std::vector<bf16> kd(static_cast<size_t>(d.Tk * d.Dk)), vd(static_cast<size_t>(d.Tk * d.Dv));
    for (int64_t item = lo; item < hi; ++item) {
      int64_t tile = item % d.tiles, bh = item / d.tiles, b = bh / d.H, h = bh % d.H;
      int64_t r0 = tile * kAttentionTile, r1 = std::min(d.T, r0 + kAttentionTile), tq = r1 - r0;
      int64_t width = d.off + r1;
      const int64_t ooff = ((b * d.T + r0) * d.H + h) * d.Dv;
      pack_rows(qd.data(), pq + ((b * d.T + r0) * d.H + h) * d.Dk, tq, d.Dk, ldk);
      pack_rows(kd.data(), pk + (b * d.Tk * d.H + h) * d.Dk, width, d.Dk, ldk);
      pack_rows(vd.data(), pv + (b * d.Tk * d.H + h) * d.Dv, width, d.Dv, ldv);
      // S = scale Q_tile K[0:width]^T in f32
      attention_bf16_product(false, true, tq, width, d.Dk, qd.data(), d.Dk, kd.data(), d.Dk, DType::f32, S.data(),
                             width);
      for (int64_t x = 0; x < tq * width; ++x) S[static_cast<size_t>(x)] *= s;
      probabilities<float>(S.data(), tq, d.off + r0, width, nullptr, pl + bh * d.T + r0,
                           pm ? pm + bh * d.T + r0 : nullptr);
      round_bf16_row(P.data(), S.data(), tq * width);
      // O_tile = P V[0:width], rounded once into o
      attention_bf16_product(false, false, tq, d.Dv, width, P.data(), width, vd.data(), d.Dv, DType::bf16, od.data(),
                             d.Dv);
      unpack_rows(po + ooff, ldv, od.data(), tq, d.Dv);
    }
  });
}

void causal_attention_backward_bf16(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                                    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                    const Tensor& lse, double scale) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&grad_q, &grad_k, &grad_v, &grad_o, &k, &v, &o})
    MT_CHECK(t->dtype() == DType::bf16, "causal_attention_backward: bf16 q needs bf16 k, v, o and gradients; got {}",
             t->dtype());
  MT_CHECK(lse.dtype() == DType::f32, "causal_attention_backward: bf16 q needs f32 lse; got {}", lse.dtype());
  Dims d = dims_of(q, k, v);
  const bf16* pq = q.data<bf16>();
  const bf16* pk = k.data<bf16>();
  const bf16* pv = v.data<bf16>();
  const bf16* po = o.data<bf16>();
  const bf16* pdo = grad_o.data<bf16>();
  const float* pl = lse.data<float>();
  bf16* dq = grad_q.data<bf16>();
  bf16* dk = grad_k.data<bf16>();
  bf16* dv = grad_v.data<bf16>();
  const int64_t ldk = d.H * d.Dk, ldv = d.H * d.Dv;
  const float s = static_cast<float>(scale);
  parallel_for(d.B * d.H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> P(static_cast<size_t>(kAttentionTile * d.Tk)), dS(P.size()), D(kAttentionTile);
    std::vector<bf16> P16(P.size()), dS16(P.size());
    // dK, dV of one head in f32 ([Tk, Dk], [Tk, Dv], dense), from grad_k / grad_v (the op passes zeros).
    std::vector<float> dk_acc(static_cast<size_t>(d.Tk * d.Dk)), dv_acc(static_cast<size_t>(d.Tk * d.Dv));
    std::vector<float> go_row(static_cast<size_t>(d.Dv)), o_row(static_cast<size_t>(d.Dv));
    // Dense copies (pack_rows): the head's K and V, the tile's Q and dO, dQ's tile.
    std::vector<bf16> kd(static_cast<size_t>(d.Tk * d.Dk)), vd(static_cast<size_t>(d.Tk * d.Dv));
    std::vector<bf16> qd(static_cast<size_t>(kAttentionTile * d.Dk)), dod(static_cast<size_t>(kAttentionTile * d.Dv));
    std::vector<bf16> dqd(qd.size());
    for (int64_t bh = lo; bh < hi; ++bh) {
      int64_t b = bh / d.H, h = bh % d.H;
      pack_rows(kd.data(), pk + (b * d.Tk * d.H + h) * d.Dk, d.Tk, d.Dk, ldk);
      pack_rows(vd.data(), pv + (b * d.Tk * d.H + h) * d.Dv, d.Tk, d.Dv, ldv);
      bf16* dk_head = dk + (b * d.Tk * d.H + h) * d.Dk;
      bf16* dv_head = dv + (b * d.Tk * d.H + h) * d.Dv;
      for (int64_t t = 0; t < d.Tk; ++t) {
        widen_bf16_row(&dk_acc[static_cast<size_t>(t * d.Dk)], dk_head + t * ldk, d.Dk);
        widen_bf16_row(&dv_acc[static_cast<size_t>(t * d.Dv)], dv_head + t * ldv, d.Dv);
      }
      for (int64_t tile = 0; tile < d.tiles; ++tile) {
        int64_t r0 = tile * kAttentionTile, r1 = std::min(d.T, r0 + kAttentionTile), tq = r1 - r0;
        int64_t width = d.off + r1;
        int64_t qoff = ((b * d.T + r0) * d.H + h) * d.Dk, ooff = ((b * d.T + r0) * d.H + h) * d.Dv;
        pack_rows(qd.data(), pq + qoff, tq, d.Dk, ldk);
        pack_rows(dod.data(), pdo + ooff, tq, d.Dv, ldv);
        attention_bf16_product(false, true, tq, width, d.Dk, qd.data(), d.Dk, kd.data(), d.Dk, DType::f32, P.data(),
                               width);
        for (int64_t x = 0; x < tq * width; ++x) P[static_cast<size_t>(x)] *= s;
        probabilities<float>(P.data(), tq, d.off + r0, width, pl + bh * d.T + r0, nullptr);
        // dP = dO_tile V[0:width]^T   [tq, width], f32
        attention_bf16_product(false, true, tq, width, d.Dv, dod.data(), d.Dv, vd.data(), d.Dv, DType::f32, dS.data(),
                               width);
        for (int64_t i = 0; i < tq; ++i) {
          widen_bf16_row(go_row.data(), pdo + ooff + i * ldv, d.Dv);
          widen_bf16_row(o_row.data(), po + ooff + i * ldv, d.Dv);
          float acc = 0;
          for (int64_t j = 0; j < d.Dv; ++j) acc += go_row[static_cast<size_t>(j)] * o_row[static_cast<size_t>(j)];
          D[static_cast<size_t>(i)] = acc;
        }
        run_vector_isa([](auto... a) { softmax_grad_rows<float>(a...); }, dS.data(),
                       static_cast<const float*>(P.data()), static_cast<const float*>(D.data()), tq, width);
        // bf16 operands: P and scale dS.
        for (int64_t x = 0; x < tq * width; ++x) dS[static_cast<size_t>(x)] *= s;
        round_bf16_row(dS16.data(), dS.data(), tq * width);
        round_bf16_row(P16.data(), P.data(), tq * width);
        // dQ_tile = (scale dS) K[0:width];  dK[0:width] += (scale dS)^T Q_tile;  dV[0:width] += P^T dO_tile
        attention_bf16_product(false, false, tq, d.Dk, width, dS16.data(), width, kd.data(), d.Dk, DType::bf16,
                               dqd.data(), d.Dk);
        unpack_rows(dq + qoff, ldk, dqd.data(), tq, d.Dk);
        attention_bf16_product(true, false, width, d.Dk, tq, dS16.data(), width, qd.data(), d.Dk, DType::f32,
                               dk_acc.data(), d.Dk, true);
        attention_bf16_product(true, false, width, d.Dv, tq, P16.data(), width, dod.data(), d.Dv, DType::f32,
                               dv_acc.data(), d.Dv, true);
      }
      for (int64_t t = 0; t < d.Tk; ++t) {
        round_bf16_row(dk_head + t * ldk, &dk_acc[static_cast<size_t>(t * d.Dk)], d.Dk);
        round_bf16_row(dv_head + t * ldv, &dv_acc[static_cast<size_t>(t * d.Dv)], d.Dv);
      }
    }
  });
}

}  // namespace

void causal_attention_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                              double scale, Tensor* row_max) {
  if (q.dtype() == DType::bf16) return causal_attention_forward_bf16(o, lse, q, k, v, scale, row_max);
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
  if (q.dtype() == DType::bf16)
    return causal_attention_backward_bf16(grad_q, grad_k, grad_v, grad_o, q, k, v, o, lse, scale);
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
