// SiTU-GLU kernels: elementwise, parallel over contiguous ranges. The β gradient
// is summed per chunk in double and the chunk sums added in order, so it is
// reproducible for a fixed thread count. The loops are compiled three times
// (portable, AVX2 + FMA, AVX-512) and cpu::vector_isa() picks the copy
// (backend/cpu/isa.h): each element is computed by the same scalar expression in every
// copy, only the vector width differs.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_rows.h"
#include "ops/common/math.h"
#include "ops/situ/situ_kernels.h"

namespace moetrain::cpu {

namespace {

// The loops over [lo, hi), as functions of their own so that the cap is a template
// argument (no branch in the loop), inlined into one function per ISA below.
template <class T, bool kCap>
inline void situ_forward_range(
    const T* __restrict pg, const T* __restrict pu, T* __restrict po, int64_t lo, int64_t hi, T b, T inv_b, T l,
    T inv_l) {
  for (int64_t i = lo; i < hi; ++i) {
    T g = pg[i];
    T a = b * tanh_of(g * inv_b) * sigmoid_of(g);
    T u = kCap ? l * tanh_of(pu[i] * inv_l) : pu[i];
    po[i] = a * u;
  }
}

// Returns this range's share of dβ (0 unless kBeta).
template <class T, bool kCap, bool kBeta>
inline double situ_backward_range(
    const T* __restrict pg, const T* __restrict pu, const T* __restrict dout, T* __restrict dg, T* __restrict du,
    int64_t lo, int64_t hi, T b, T inv_b, T l, T inv_l) {
  double beta_sum = 0;
  for (int64_t i = lo; i < hi; ++i) {
    T g = pg[i], s = sigmoid_of(g), th = tanh_of(g * inv_b);
    T a = b * th * s;
    T u = pu[i], du_dup = T(1);
    if (kCap) {
      T tu = tanh_of(u * inv_l);
      u = l * tu;
      du_dup = T(1) - tu * tu;
    }
    // ∂a/∂g = (1 - tanh²(g/β)) σ(g) + β tanh(g/β) σ(g)(1 - σ(g))
    T da_dg = (T(1) - th * th) * s + b * th * s * (T(1) - s);
    dg[i] = dout[i] * u * da_dg;
    du[i] = dout[i] * a * du_dup;
    if (kBeta) {
      T r = g * inv_b;
      beta_sum += static_cast<double>(dout[i] * u * s * (th - r * (T(1) - th * th)));
    }
  }
  return beta_sum;
}

// The loops in the copy cpu::vector_isa() picks (run_vector_isa, backend/cpu/isa.h:
// the loop, tanh_of and sigmoid_of inlined into a function compiled for the ISA).
template <class T, bool kCap>
void situ_forward_copy(const T* pg, const T* pu, T* po, int64_t lo, int64_t hi, T b, T inv_b, T l, T inv_l) {
  run_vector_isa([](auto... a) { situ_forward_range<T, kCap>(a...); }, pg, pu, po, lo, hi, b, inv_b, l, inv_l);
}

template <class T, bool kCap, bool kBeta>
double situ_backward_copy(const T* pg, const T* pu, const T* dout, T* dg, T* du, int64_t lo, int64_t hi, T b, T inv_b,
                          T l, T inv_l) {
  return run_vector_isa([](auto... a) { return situ_backward_range<T, kCap, kBeta>(a...); }, pg, pu, dout, dg, du, lo,
                        hi, b, inv_b, l, inv_l);
}

// bf16 tensors: the f32 loops on blocks of kSituBlock elements widened into per-thread
// buffers, the results rounded once (the bits of cpu::run_kernel's widening, without
// f32 copies of the whole tensors; dβ is summed per block, so its last bits may differ).
constexpr int64_t kSituBlock = 1024;

template <bool kCap>
void situ_forward_bf16(const bf16* pg, const bf16* pu, bf16* po, int64_t lo, int64_t hi, float b, float inv_b,
                       float l, float inv_l) {
  float g[kSituBlock], u[kSituBlock], o[kSituBlock];
  for (int64_t x0 = lo; x0 < hi; x0 += kSituBlock) {
    const int64_t len = std::min(kSituBlock, hi - x0);
    widen_bf16_row(g, pg + x0, len);
    widen_bf16_row(u, pu + x0, len);
    situ_forward_copy<float, kCap>(g, u, o, 0, len, b, inv_b, l, inv_l);
    round_bf16_row(po + x0, o, len);
  }
}

template <bool kCap, bool kBeta>
double situ_backward_bf16(const bf16* pg, const bf16* pu, const bf16* dout, bf16* dg, bf16* du, int64_t lo,
                          int64_t hi, float b, float inv_b, float l, float inv_l) {
  float g[kSituBlock], u[kSituBlock], d[kSituBlock], og[kSituBlock], ou[kSituBlock];
  double beta_sum = 0;
  for (int64_t x0 = lo; x0 < hi; x0 += kSituBlock) {
    const int64_t len = std::min(kSituBlock, hi - x0);
    widen_bf16_row(g, pg + x0, len);
    widen_bf16_row(u, pu + x0, len);
    widen_bf16_row(d, dout + x0, len);
    beta_sum += situ_backward_copy<float, kCap, kBeta>(g, u, d, og, ou, 0, len, b, inv_b, l, inv_l);
    round_bf16_row(dg + x0, og, len);
    round_bf16_row(du + x0, ou, len);
  }
  return beta_sum;
}

}  // namespace

void situ_glu_forward(Tensor& out, const Tensor& gate, const Tensor& up, double beta, double lambda) {
  if (gate.dtype() == DType::bf16) {
    MT_CHECK(up.dtype() == DType::bf16 && out.dtype() == DType::bf16, "situ_glu: gate is bf16 but up is {}, out {}",
             up.dtype(), out.dtype());
    const bf16* pg = gate.data<bf16>();
    const bf16* pu = up.data<bf16>();
    bf16* po = out.data<bf16>();
    const float b = static_cast<float>(beta), inv_b = static_cast<float>(1.0 / beta);
    const float l = static_cast<float>(lambda), inv_l = lambda > 0 ? static_cast<float>(1.0 / lambda) : 0.0f;
    parallel_for(gate.numel(), 4096, [&](int64_t lo, int64_t hi) {
      if (lambda > 0) situ_forward_bf16<true>(pg, pu, po, lo, hi, b, inv_b, l, inv_l);
      else situ_forward_bf16<false>(pg, pu, po, lo, hi, b, inv_b, l, inv_l);
    });
    return;
  }
  dispatch_float(gate.dtype(), "situ_glu", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = gate.data<T>();
    const T* pu = up.data<T>();
    T* po = out.data<T>();
    const T b = static_cast<T>(beta), inv_b = static_cast<T>(1.0 / beta);
    const T l = static_cast<T>(lambda), inv_l = lambda > 0 ? static_cast<T>(1.0 / lambda) : T(0);
    const bool cap_up = lambda > 0;
    parallel_for(gate.numel(), 4096, [&](int64_t lo, int64_t hi) {
      if (cap_up) situ_forward_copy<T, true>(pg, pu, po, lo, hi, b, inv_b, l, inv_l);
      else situ_forward_copy<T, false>(pg, pu, po, lo, hi, b, inv_b, l, inv_l);
    });
  });
}

void situ_glu_backward(Tensor& grad_gate, Tensor& grad_up, double* grad_beta, const Tensor& grad_out,
                       const Tensor& gate, const Tensor& up, double beta, double lambda) {
  // bf16 gate, up and gradients: situ_backward_bf16 (blocks widened and rounded).
  const bool narrow = gate.dtype() == DType::bf16;
  dispatch_float(narrow ? DType::f32 : gate.dtype(), "situ_glu_backward", [&](auto tag) {
    using T = decltype(tag);
    using S = std::conditional_t<std::is_same_v<T, float>, bf16, T>;  // the storage type when narrow
    const T* pg = narrow ? nullptr : gate.data<T>();
    const T* pu = narrow ? nullptr : up.data<T>();
    const T* dout = narrow ? nullptr : grad_out.data<T>();
    T* dg = narrow ? nullptr : grad_gate.data<T>();
    T* du = narrow ? nullptr : grad_up.data<T>();
    const T b = static_cast<T>(beta), inv_b = static_cast<T>(1.0 / beta);
    const T l = static_cast<T>(lambda), inv_l = lambda > 0 ? static_cast<T>(1.0 / lambda) : T(0);
    const bool cap_up = lambda > 0;
    int64_t n = gate.numel();
    int nt = num_threads();
    std::vector<double> beta_parts(static_cast<size_t>(nt) + 1, 0.0);
    parallel_for(n, 4096, [&](int64_t lo, int64_t hi) {
      double beta_sum = 0;
      if (narrow) {
        if constexpr (std::is_same_v<T, float>) {
          const S* sg = gate.data<S>();
          const S* su = up.data<S>();
          const S* sd = grad_out.data<S>();
          S* sdg = grad_gate.data<S>();
          S* sdu = grad_up.data<S>();
          if (cap_up && grad_beta) beta_sum = situ_backward_bf16<true, true>(sg, su, sd, sdg, sdu, lo, hi, b, inv_b, l, inv_l);
          else if (cap_up) situ_backward_bf16<true, false>(sg, su, sd, sdg, sdu, lo, hi, b, inv_b, l, inv_l);
          else if (grad_beta) beta_sum = situ_backward_bf16<false, true>(sg, su, sd, sdg, sdu, lo, hi, b, inv_b, l, inv_l);
          else situ_backward_bf16<false, false>(sg, su, sd, sdg, sdu, lo, hi, b, inv_b, l, inv_l);
        }
      } else if (cap_up && grad_beta) beta_sum = situ_backward_copy<T, true, true>(pg, pu, dout, dg, du, lo, hi, b, inv_b, l, inv_l);
      else if (cap_up) situ_backward_copy<T, true, false>(pg, pu, dout, dg, du, lo, hi, b, inv_b, l, inv_l);
      else if (grad_beta) beta_sum = situ_backward_copy<T, false, true>(pg, pu, dout, dg, du, lo, hi, b, inv_b, l, inv_l);
      else situ_backward_copy<T, false, false>(pg, pu, dout, dg, du, lo, hi, b, inv_b, l, inv_l);
      if (grad_beta) {
        // Chunks are contiguous and start at distinct offsets: index them by thread.
        int c = omp_in_parallel() ? omp_get_thread_num() : 0;
        beta_parts[static_cast<size_t>(c)] = beta_sum;
      }
    });
    if (grad_beta) {
      double total = 0;
      for (double p : beta_parts) total += p;  // thread order = range order
      *grad_beta = total;
    }
  });
}

}  // namespace moetrain::cpu
