// The bodies of the CUDA kernels of the fused residual add + norm
// (add_layer_norm, add_rms_norm; docs/cuda.md, "Fused residual add and norm"),
// written once for the GPU and the host (ops/common/simt.h), so
// tests/ops/norm/add_norm_simt_test.cpp runs these very bodies on the CPU against
// the unfused CPU ops (add, then layer_norm / rms_norm). One block per row of
// [rows, n]; thread tid owns columns tid, tid + threads, ...
//   forward:  h = x + d (stored in T; the statistics read the stored h, as the
//             unfused norm reads the add's output), then mean (LayerNorm only)
//             and rstd, y = (h - mean) rstd w + b, or h rstd w (RMS, scale 1/n);
//   backward: with g = dy w, x̂ = (h - mean) rstd:
//             dx = dd = grad_h + rstd (g - mean(g) - x̂ mean(g x̂))   (LayerNorm)
//                       grad_h + rstd (g - x̂ scale Σ g x̂)             (RMS)
//             summed in the arithmetic type A and rounded to T once.
// Arithmetic in A (f32 for f32 and bf16, f64 for f64); mean and rstd stored in A.
// Block sums: each thread's columns in order, then a tree over the threads in
// shared memory (threads a power of two), a fixed order on every schedule. The
// weight and bias gradients (sums over rows) are not here: the norm family's
// chunked f64 column sums (norm_cuda.cu) take h for x.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/common/simt.h"
#include "ops/common/simt_types.h"

namespace moetrain::simt {

template <class T> using norm_acc_t = acc_of_t<T>;

MT_HOST_DEVICE inline float norm_rsqrt(float v) {
#if defined(__CUDA_ARCH__)
  return 1.0f / sqrtf(v);
#else
  return 1.0f / std::sqrt(v);
#endif
}
MT_HOST_DEVICE inline double norm_rsqrt(double v) {
#if defined(__CUDA_ARCH__)
  return 1.0 / ::sqrt(v);
#else
  return 1.0 / std::sqrt(v);
#endif
}

// One call's tensors, all [rows, n] but w, b ([n], null for none) and the
// statistics ([rows]; mean unused by RMS).
template <class T>
struct AddNormArgs {
  using A = norm_acc_t<T>;
  const T *x = nullptr, *d = nullptr, *w = nullptr, *b = nullptr;
  T *h = nullptr, *y = nullptr;
  A *mean = nullptr, *rstd = nullptr;
  // backward
  const T *grad_h = nullptr, *grad_y = nullptr;
  T* grad_x = nullptr;
  int64_t rows = 0, n = 0;
  bool centre = true;  // LayerNorm (true) or RMSNorm (false)
  double scale = 1, eps = 1e-5;  // RMS: rstd = 1/sqrt(Σ h² scale + eps)
};

// Elements of shared memory (of type A) a block of `threads` needs.
inline int64_t add_norm_shared_elements(int threads) { return 2 * static_cast<int64_t>(threads); }

// red[0] = Σ_t red[t] and red2[0] = Σ_t red2[t] (red2 may be null) over the block's
// threads by a tree: step s adds thread tid + s's value into tid's, tid < s.
MT_SIMT_BODY
template <class Block, class A>
MT_HOST_DEVICE void add_norm_tree_sum(const Block& blk, A* red, A* red2) {
  for (int s = blk.threads / 2; s >= 1; s /= 2)
    blk.each([&](int tid) {
      if (tid >= s) return;
      red[tid] += red[tid + s];
      if (red2) red2[tid] += red2[tid + s];
    });
}

// Forward of row `row`: h, y, and the row's mean (LayerNorm) and rstd.
MT_SIMT_BODY
template <class Block, class T>
MT_HOST_DEVICE void add_norm_forward_row(const Block& blk, const AddNormArgs<T>& a, int64_t row,
                                         norm_acc_t<T>* sh) {
  using A = norm_acc_t<T>;
  const int threads = blk.threads;
  const int64_t n = a.n, base = row * n;
  A *red = sh, *red2 = sh + threads;
  // h = x + d, rounded to T; red[tid] = Σ h (LayerNorm) or Σ h² (RMS) over tid's columns.
  blk.each([&](int tid) {
    A s = 0;
    for (int64_t j = tid; j < n; j += threads) {
      acc_store(a.h[base + j], acc_load(a.x[base + j]) + acc_load(a.d[base + j]));
      const A v = acc_load(a.h[base + j]);
      s += a.centre ? v : v * v;
    }
    red[tid] = s;
  });
  add_norm_tree_sum(blk, red, static_cast<A*>(nullptr));
  if (a.centre) {
    // The variance about the mean (two passes, as the CPU kernel).
    blk.each([&](int tid) {
      const A mu = red[0] / static_cast<A>(n);
      A s = 0;
      for (int64_t j = tid; j < n; j += threads) {
        const A c = acc_load(a.h[base + j]) - mu;
        s += c * c;
      }
      red2[tid] = s;
    });
    add_norm_tree_sum(blk, red2, static_cast<A*>(nullptr));
  }
  blk.each([&](int tid) {
    const A mu = a.centre ? red[0] / static_cast<A>(n) : A(0);
    const A rs = a.centre ? norm_rsqrt(red2[0] / static_cast<A>(n) + static_cast<A>(a.eps))
                          : norm_rsqrt(red[0] * static_cast<A>(a.scale) + static_cast<A>(a.eps));
    if (tid == 0) {
      if (a.centre) a.mean[row] = mu;
      a.rstd[row] = rs;
    }
    for (int64_t j = tid; j < n; j += threads) {
      const A v = (acc_load(a.h[base + j]) - mu) * rs * (a.w ? acc_load(a.w[j]) : A(1)) +
                  (a.b ? acc_load(a.b[j]) : A(0));
      acc_store(a.y[base + j], v);
    }
  });
}

// Backward of row `row`: grad_x = grad_h + the norm's input gradient (one
// rounding to T). Reads h, mean (LayerNorm) and rstd of the forward.
MT_SIMT_BODY
template <class Block, class T>
MT_HOST_DEVICE void add_norm_backward_row(const Block& blk, const AddNormArgs<T>& a, int64_t row,
                                          norm_acc_t<T>* sh) {
  using A = norm_acc_t<T>;
  const int threads = blk.threads;
  const int64_t n = a.n, base = row * n;
  A *red = sh, *red2 = sh + threads;
  const A mu = a.centre ? a.mean[row] : A(0), rs = a.rstd[row];
  // red[tid] = Σ g, red2[tid] = Σ g x̂ over tid's columns.
  blk.each([&](int tid) {
    A sg = 0, sgx = 0;
    for (int64_t j = tid; j < n; j += threads) {
      const A g = acc_load(a.grad_y[base + j]) * (a.w ? acc_load(a.w[j]) : A(1));
      sg += g;
      sgx += g * ((acc_load(a.h[base + j]) - mu) * rs);
    }
    red[tid] = sg;
    red2[tid] = sgx;
  });
  add_norm_tree_sum(blk, red, red2);
  blk.each([&](int tid) {
    const A mg = a.centre ? red[0] / static_cast<A>(n) : A(0);
    const A mgx = a.centre ? red2[0] / static_cast<A>(n) : red2[0] * static_cast<A>(a.scale);
    for (int64_t j = tid; j < n; j += threads) {
      const A g = acc_load(a.grad_y[base + j]) * (a.w ? acc_load(a.w[j]) : A(1));
      const A xh = (acc_load(a.h[base + j]) - mu) * rs;
      acc_store(a.grad_x[base + j], acc_load(a.grad_h[base + j]) + rs * (g - mg - xh * mgx));
    }
  });
}

}  // namespace moetrain::simt
