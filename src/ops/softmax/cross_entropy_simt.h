// The bodies of the CUDA cross-entropy kernels (softmax_cuda.cu), written once
// for the GPU and the host (ops/common/simt.h), so
// tests/ops/softmax/cross_entropy_simt_test.cpp runs these very bodies on the CPU
// against the CPU op. One block per row of logits [rows, v]; only the first
// num_classes columns are classes (the rest, a padded vocabulary's columns,
// docs/model.md#padded-vocabulary, are outside the softmax and get gradient 0).
//
// Storage T is f32, f64 or bf16 (moetrain::bf16 on the host, __nv_bfloat16 on
// the GPU); arithmetic in A = f32 for f32 and bf16, f64 for f64, and the per-row
// log-sum-exp, row losses and their total in f64. The loss is stored as A (f32
// for bf16 logits: the logged loss keeps its digits), the gradient as T, each
// element computed in A and rounded once: for bf16 logits the gradient is the
// f32 logits' gradient rounded to bf16 (the host test checks it bit for bit).
//
//   rows:     one pass over the row: each thread keeps a running (max m, Σ e^{x-m})
//             over its strided columns, rescaling the sum when the max grows; a
//             tree over the block combines the pairs; thread 0 writes
//             lse = m + log Σ (f64; -inf for a row of -inf) and the row loss
//             lse - x[target] (0 for an ignored row).
//   total:    the counted rows (target != ignore_index) and Σ_r row_loss[r], strided
//             and a tree (one block); loss = Σ / divisor, divisor = max(counted, 1)
//             for the mean, 1 for the sum; `counted` kept on the device for backward.
//   backward: grad[r, j] = scale e^{x - lse} (A), the target's entry
//             scale (e^{x_t - lse} - 1) in f64; ignored rows and padding columns 0;
//             scale = grad_loss / divisor.
// Every sum runs in a fixed order, so a run repeats itself bit for bit.
// Targets on the device are not range-checked on the host (that would wait for
// the GPU every step; the data loader checks every id when it opens a shard,
// docs/cuda.md#cross-entropy-on-bf16-logits): a target outside [0, num_classes)
// that is not ignore_index makes its row loss and its gradient row NaN, which the
// trainer's non-finite guard reports, instead of reading outside the row.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "ops/common/simt.h"
#include "ops/common/simt_types.h"  // acc_of_t, acc_load, acc_store

namespace moetrain::simt {

MT_HOST_DEVICE inline double ce_log(double x) {
#if defined(__CUDA_ARCH__)
  return ::log(x);
#else
  return std::log(x);
#endif
}

// Shapes, inputs and outputs of one cross-entropy call (I: i32 or i64 targets).
template <class T, class I>
struct CrossEntropyArgs {
  const T* logits = nullptr;  // [rows, v]
  const I* targets = nullptr;  // [rows]
  double* lse = nullptr;       // [rows]: written by rows, read by backward
  double* row_loss = nullptr;  // [rows]: written by rows, read by total
  T* grad = nullptr;           // [rows, v]: backward
  int64_t rows = 0, v = 0, num_classes = 0, ignore_index = -100;
};

// Doubles of the rows body's shared memory: a (max, sum) pair per thread.
inline int64_t cross_entropy_shared_elements(int threads) { return 2 * static_cast<int64_t>(threads); }

// Row r's lse and loss; sh holds cross_entropy_shared_elements(threads) doubles.
// threads: a power of two (the tree). The exponentials are in A, their sums in
// f64 (as the CPU kernel sums them), so a thread's few hundred terms of a
// 50K-wide row lose nothing to the accumulation.
MT_SIMT_BODY
template <class Block, class T, class I>
MT_HOST_DEVICE void cross_entropy_row(const Block& blk, const CrossEntropyArgs<T, I>& a, int64_t r, double* sh) {
  using A = acc_of_t<T>;
  const int threads = blk.threads;
  const A neg_inf = static_cast<A>(-INFINITY);
  double* m = sh;            // [threads] running maxima (values of A)
  double* s = sh + threads;  // [threads] Σ e^{x - m}
  const T* x = a.logits + r * a.v;
  blk.each([&](int tid) {
    A mt = neg_inf;
    double st = 0;
    for (int64_t j = tid; j < a.num_classes; j += threads) {
      const A xj = acc_load(x[j]);
      if (xj > mt) {  // the max grows: rescale the sum (e^{-inf} = 0 for the first column)
        st = st * static_cast<double>(exp_a(mt - xj)) + 1.0;
        mt = xj;
      } else if (xj == xj && mt != neg_inf) {
        st += static_cast<double>(exp_a(xj - mt));
      } else if (xj != xj) {  // NaN poisons the row, as in the CPU kernel
        mt = xj;
        st = static_cast<double>(xj);
      }
    }
    m[tid] = static_cast<double>(mt);
    s[tid] = st;
  });
  // Tree over the threads: step k combines thread tid < k with tid + k.
  for (int k = threads / 2; k >= 1; k /= 2)
    blk.each([&](int tid) {
      if (tid >= k) return;
      const A m1 = static_cast<A>(m[tid]), m2 = static_cast<A>(m[tid + k]);
      const double s1 = s[tid], s2 = s[tid + k];
      if (m1 != m1 || m2 != m2) {
        m[tid] = m1 != m1 ? m[tid] : m[tid + k];
        s[tid] = m[tid];
      } else if (m2 == neg_inf) {
        // nothing to add
      } else if (m1 == neg_inf) {
        m[tid] = m[tid + k];
        s[tid] = s2;
      } else if (m2 > m1) {
        m[tid] = m[tid + k];
        s[tid] = s1 * static_cast<double>(exp_a(m1 - m2)) + s2;
      } else {
        s[tid] = s1 + s2 * static_cast<double>(exp_a(m2 - m1));
      }
    });
  blk.each([&](int tid) {
    if (tid != 0) return;
    const double mr = m[0];
    const double l = mr == static_cast<double>(neg_inf) ? mr : mr + ce_log(s[0]);
    a.lse[r] = l;
    const int64_t t = static_cast<int64_t>(a.targets[r]);
    a.row_loss[r] = t == a.ignore_index                   ? 0.0
                    : t < 0 || t >= a.num_classes         ? static_cast<double>(NAN)
                                                          : l - static_cast<double>(acc_load(x[t]));
  });
}

// Doubles of the total body's shared memory: a (sum, count) pair per thread.
inline int64_t cross_entropy_total_shared_elements(int threads) { return 2 * static_cast<int64_t>(threads); }

// The divisor of the loss: the counted rows for the mean (at least 1), 1 for the sum.
MT_HOST_DEVICE inline double cross_entropy_divisor(double counted, bool mean) {
  return mean ? (counted > 1.0 ? counted : 1.0) : 1.0;
}

// loss[0] = Σ row_loss / divisor (as L), counted[0] = the rows whose target is not
// ignore_index (f64, exact below 2^53).
MT_SIMT_BODY
template <class Block, class L, class I>
MT_HOST_DEVICE void cross_entropy_total(const Block& blk, L* loss, double* counted, const double* row_loss,
                                        const I* targets, int64_t rows, int64_t ignore_index, bool mean,
                                        double* sh) {
  const int threads = blk.threads;
  double* sum = sh;
  double* count = sh + threads;
  blk.each([&](int tid) {
    double acc = 0, n = 0;
    for (int64_t r = tid; r < rows; r += threads) {
      acc += row_loss[r];
      n += static_cast<int64_t>(targets[r]) != ignore_index ? 1.0 : 0.0;
    }
    sum[tid] = acc;
    count[tid] = n;
  });
  for (int k = threads / 2; k >= 1; k /= 2)
    blk.each([&](int tid) {
      if (tid >= k) return;
      sum[tid] += sum[tid + k];
      count[tid] += count[tid + k];
    });
  blk.each([&](int tid) {
    if (tid != 0) return;
    *loss = static_cast<L>(sum[0] / cross_entropy_divisor(count[0], mean));
    *counted = count[0];
  });
}

// Row r's gradient: scale (softmax - onehot(target)) over the classes, 0 elsewhere
// (NaN for a target out of range, as its row loss).
MT_SIMT_BODY
template <class Block, class T, class I>
MT_HOST_DEVICE void cross_entropy_backward_row(const Block& blk, const CrossEntropyArgs<T, I>& a, int64_t r,
                                               double scale) {
  using A = acc_of_t<T>;
  const int threads = blk.threads;
  const T* x = a.logits + r * a.v;
  T* g = a.grad + r * a.v;
  const int64_t t = static_cast<int64_t>(a.targets[r]);
  const bool ignored = t == a.ignore_index;
  if (!ignored && (t < 0 || t >= a.num_classes)) {
    blk.each([&](int tid) {
      for (int64_t j = tid; j < a.v; j += threads) acc_store(g[j], static_cast<A>(NAN));
    });
    return;
  }
  const double l = a.lse[r];
  const A sc = static_cast<A>(scale), lt = static_cast<A>(l);  // lse rounded to A: <= 1 ulp of it
  blk.each([&](int tid) {
    for (int64_t j = tid; j < a.v; j += threads) {
      A gj = 0;
      if (!ignored && j < a.num_classes) {
        if (j == t) gj = static_cast<A>(scale * (exp_a(static_cast<double>(acc_load(x[j])) - l) - 1.0));
        else gj = sc * exp_a(acc_load(x[j]) - lt);
      }
      acc_store(g[j], gj);
    }
  });
}

}  // namespace moetrain::simt
