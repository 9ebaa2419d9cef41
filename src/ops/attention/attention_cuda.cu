// Causal attention on CUDA, FlashAttention-style (twin of attention_cpu.cpp):
// tiles of 32 query rows and 32 keys staged in shared memory, the softmax taken
// online (running max m and sum l per row, the output rescaled by e^{m_old -
// m_new}), so no [T, Tk] matrix is ever stored. Arithmetic in acc_t<T>: f32 for
// f32 and bf16 (bf16 values are widened as they are staged), f64 for f64. The
// forward saves lse = m + log l per row ([B, H, T], f32 for bf16 inputs) and
// the backward recomputes P = e^{S - lse} from it. Asked for, it also saves the
// running max m of each row after its last key tile (row_max, as lse): QK-Clip's
// statistic, docs/model.md#qk-clip.
//
// Layout: q [B, T, H, Dk], k [B, Tk, H, Dk], v [B, Tk, H, Dv], o [B, T, H, Dv];
// query row t sits at absolute position off + t (off = Tk - T) and sees keys
// s <= off + t. Head dims up to 256.
//
// Work split (block = 8 warps):
//   forward  (query tile):  warp w owns rows 4w..4w+3, lane = key of the key tile,
//                           a lane holds output dims lane, lane + 32, ...
//   dK, dV   (key tile):    warp w owns keys 4w..4w+3, lane = query row of the
//                           query tile; loops over the query tiles that see the keys
//   dQ       (query tile):  as the forward
// dQ and dK/dV are separate kernels (P and dP are recomputed in each) so that no
// gradient needs atomics: every result is written once, deterministically.
// Backward overwrites grad_q, grad_k and grad_v. bf16 with head dims that are
// multiples of 16 goes to the tensor-core kernels instead (attention_tc_cuda.cu).
#include <algorithm>

#include "ops/attention/attention_kernels.h"
#include "ops/common/cuda_helpers.cuh"

namespace moetrain::cuda {

namespace {

constexpr int kBr = 32;           // query rows per tile
constexpr int kBc = 32;           // keys per tile (= warp size: lane <-> key or row)
constexpr int kWarps = 8;
constexpr int kPerWarp = kBr / kWarps;  // rows (forward, dQ) or keys (dK/dV) per warp
constexpr int kMaxHeadDim = 256;
static_assert(kBr == 32 && kBc == 32 && kPerWarp * kWarps == kBr);

struct Dims {
  int64_t B, T, Tk, off, H, Dk, Dv;
};

__device__ __forceinline__ int64_t row_q(const Dims& d, int64_t b, int64_t t, int64_t h) {
  return ((b * d.T + t) * d.H + h);
}
__device__ __forceinline__ int64_t row_k(const Dims& d, int64_t b, int64_t s, int64_t h) {
  return ((b * d.Tk + s) * d.H + h);
}

// rows x cols of a [.., H, dim] tensor from row `first` on (rows past `limit`
// read as 0) into shared memory with row stride `ld`, widened to A.
template <class T, class A>
__device__ void stage(A* dst, int ld, const T* src, const Dims& d, int64_t b, int64_t h, int64_t first, int64_t limit,
                      int64_t len, int dim, bool keys) {
  for (int e = threadIdx.x; e < kBr * dim; e += blockDim.x) {
    int i = e / dim, c = e % dim;
    int64_t t = first + i;
    A val = A(0);
    if (t < limit) val = load(src, (keys ? row_k(d, b, t, h) : row_q(d, b, t, h)) * len + c);
    dst[i * ld + c] = val;
  }
}

template <class T, int kD32>
__global__ void __launch_bounds__(kWarps * 32)
    attention_forward_kernel(T* o, acc_t<T>* lse, acc_t<T>* row_max, const T* q, const T* k, const T* v, Dims d,
                             double scale_d) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int Dk = static_cast<int>(d.Dk), Dv = static_cast<int>(d.Dv);
  A* Qs = reinterpret_cast<A*>(smem);  // [kBr][Dk]     read as broadcasts
  A* Ks = Qs + kBr * Dk;               // [kBc][Dk + 1] lane c reads row c: padded
  A* Vs = Ks + kBc * (Dk + 1);         // [kBc][Dv]
  const A scale = static_cast<A>(scale_d);
  const int64_t bh = blockIdx.y, b = bh / d.H, h = bh % d.H;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kBr;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  stage(Qs, Dk, q, d, b, h, r0, d.T, d.Dk, Dk, false);

  A m[kPerWarp], l[kPerWarp], acc[kPerWarp][kD32];
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr) {
    m[rr] = neg_inf<A>();
    l[rr] = A(0);
#pragma unroll
    for (int j = 0; j < kD32; ++j) acc[rr][j] = A(0);
  }
  // Rows past T are computed as row T - 1 (never stored) so every row has a key.
  const int64_t r_last = std::min<int64_t>(d.T, r0 + kBr) - 1;
  const int64_t kv_end = d.off + r_last + 1;  // keys [0, kv_end) are seen by some row of the tile
  for (int64_t c0 = 0; c0 < kv_end; c0 += kBc) {
    __syncthreads();  // the previous tile is consumed (and Qs is staged)
    stage(Ks, Dk + 1, k, d, b, h, c0, d.Tk, d.Dk, Dk, true);
    stage(Vs, Dv, v, d, b, h, c0, d.Tk, d.Dv, Dv, true);
    __syncthreads();
    const int64_t s = c0 + lane;
#pragma unroll
    for (int rr = 0; rr < kPerWarp; ++rr) {
      const int i = warp * kPerWarp + rr;
      const int64_t t = std::min<int64_t>(r0 + i, d.T - 1);
      A score = neg_inf<A>();
      if (s <= d.off + t) {  // implies s < Tk
        A dot = 0;
        for (int c = 0; c < Dk; ++c) dot += Qs[i * Dk + c] * Ks[lane * (Dk + 1) + c];
        score = dot * scale;
      }
      // Key 0 is in the first tile and seen by every row, so m_new is finite.
      A m_new = max(m[rr], warp_max(score));
      A p = exp_a(score - m_new);          // 0 for masked keys
      A alpha = exp_a(m[rr] - m_new);      // 0 on the first tile
      l[rr] = l[rr] * alpha + warp_sum(p);
      m[rr] = m_new;
#pragma unroll
      for (int j = 0; j < kD32; ++j) acc[rr][j] *= alpha;
      for (int c = 0; c < kBc; ++c) {
        A pc = __shfl_sync(0xffffffffu, p, c);
#pragma unroll
        for (int j = 0; j < kD32; ++j) {
          int dd = lane + 32 * j;
          if (dd < Dv) acc[rr][j] += pc * Vs[c * Dv + dd];
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr) {
    const int64_t t = r0 + warp * kPerWarp + rr;
    if (t >= d.T) continue;
    A inv = A(1) / l[rr];
#pragma unroll
    for (int j = 0; j < kD32; ++j) {
      int dd = lane + 32 * j;
      if (dd < Dv) store(o, row_q(d, b, t, h) * d.Dv + dd, acc[rr][j] * inv);
    }
    if (lane == 0) {
      lse[bh * d.T + t] = m[rr] + log_a(l[rr]);
      if (row_max) row_max[bh * d.T + t] = m[rr];  // max over the row's keys of scale q·k
    }
  }
}

// delta[b, h, t] = Σ_d dO[b, t, h, d] O[b, t, h, d]: one warp per row.
template <class T>
__global__ void attention_delta_kernel(acc_t<T>* delta, const T* grad_o, const T* o, Dims d) {
  using A = acc_t<T>;
  const int64_t rows = d.B * d.H * d.T;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int lane = threadIdx.x & 31;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); w < rows; w += warps) {
    int64_t t = w % d.T, bh = w / d.T, b = bh / d.H, h = bh % d.H;  // w = (b H + h) T + t
    int64_t base = row_q(d, b, t, h) * d.Dv;
    A acc = 0;
    for (int64_t c = lane; c < d.Dv; c += 32) acc += load(grad_o, base + c) * load(o, base + c);
    acc = warp_sum(acc);
    if (lane == 0) delta[w] = acc;
  }
}

// dV[s] = Σ_t P[t, s] dO[t],  dK[s] = scale Σ_t dS[t, s] Q[t],  dS = P (dO·V_s - delta_t).
template <class T, int kDk32, int kDv32>
__global__ void __launch_bounds__(kWarps * 32)
    attention_grad_kv_kernel(T* grad_k, T* grad_v, const T* q, const T* k, const T* v, const T* grad_o,
                             const acc_t<T>* lse, const acc_t<T>* delta, Dims d, double scale_d) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int Dk = static_cast<int>(d.Dk), Dv = static_cast<int>(d.Dv);
  A* Ks = reinterpret_cast<A*>(smem);  // [kBc][Dk]      read as broadcasts
  A* Vs = Ks + kBc * Dk;               // [kBc][Dv]
  A* Qs = Vs + kBc * Dv;               // [kBr][Dk + 1]  lane i reads row i: padded
  A* dOs = Qs + kBr * (Dk + 1);        // [kBr][Dv + 1]
  A* lse_s = dOs + kBr * (Dv + 1);     // [kBr]
  A* delta_s = lse_s + kBr;            // [kBr]
  const A scale = static_cast<A>(scale_d);
  const int64_t bh = blockIdx.y, b = bh / d.H, h = bh % d.H;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kBc;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  stage(Ks, Dk, k, d, b, h, s0, d.Tk, d.Dk, Dk, true);
  stage(Vs, Dv, v, d, b, h, s0, d.Tk, d.Dv, Dv, true);
  A dk[kPerWarp][kDk32], dv[kPerWarp][kDv32];
#pragma unroll
  for (int cc = 0; cc < kPerWarp; ++cc) {
#pragma unroll
    for (int j = 0; j < kDk32; ++j) dk[cc][j] = A(0);
#pragma unroll
    for (int j = 0; j < kDv32; ++j) dv[cc][j] = A(0);
  }
  // Query t sees key s when t >= s - off: start at the tile holding the first such t.
  const int64_t t_first = std::max<int64_t>(0, s0 - d.off);
  for (int64_t r0 = t_first / kBr * kBr; r0 < d.T; r0 += kBr) {
    __syncthreads();  // the previous query tile is consumed (and K, V are staged)
    stage(Qs, Dk + 1, q, d, b, h, r0, d.T, d.Dk, Dk, false);
    stage(dOs, Dv + 1, grad_o, d, b, h, r0, d.T, d.Dv, Dv, false);
    if (threadIdx.x < kBr) {
      int64_t t = r0 + threadIdx.x;
      lse_s[threadIdx.x] = t < d.T ? lse[bh * d.T + t] : A(0);
      delta_s[threadIdx.x] = t < d.T ? delta[bh * d.T + t] : A(0);
    }
    __syncthreads();
    const int64_t t = r0 + lane;  // this lane's query row
#pragma unroll
    for (int cc = 0; cc < kPerWarp; ++cc) {
      const int key = warp * kPerWarp + cc;
      const int64_t s = s0 + key;
      A p = A(0), ds = A(0);
      if (t < d.T && s <= d.off + t) {  // implies s < Tk
        A dot = 0, dp = 0;
        for (int c = 0; c < Dk; ++c) dot += Qs[lane * (Dk + 1) + c] * Ks[key * Dk + c];
        for (int c = 0; c < Dv; ++c) dp += dOs[lane * (Dv + 1) + c] * Vs[key * Dv + c];
        p = exp_a(dot * scale - lse_s[lane]);
        ds = p * (dp - delta_s[lane]);
      }
      for (int i = 0; i < kBr; ++i) {
        A pi = __shfl_sync(0xffffffffu, p, i), dsi = __shfl_sync(0xffffffffu, ds, i);
#pragma unroll
        for (int j = 0; j < kDv32; ++j) {
          int dd = lane + 32 * j;
          if (dd < Dv) dv[cc][j] += pi * dOs[i * (Dv + 1) + dd];
        }
#pragma unroll
        for (int j = 0; j < kDk32; ++j) {
          int dd = lane + 32 * j;
          if (dd < Dk) dk[cc][j] += dsi * Qs[i * (Dk + 1) + dd];
        }
      }
    }
  }
#pragma unroll
  for (int cc = 0; cc < kPerWarp; ++cc) {
    const int64_t s = s0 + warp * kPerWarp + cc;
    if (s >= d.Tk) continue;
#pragma unroll
    for (int j = 0; j < kDk32; ++j) {
      int dd = lane + 32 * j;
      if (dd < Dk) store(grad_k, row_k(d, b, s, h) * d.Dk + dd, dk[cc][j] * scale);
    }
#pragma unroll
    for (int j = 0; j < kDv32; ++j) {
      int dd = lane + 32 * j;
      if (dd < Dv) store(grad_v, row_k(d, b, s, h) * d.Dv + dd, dv[cc][j]);
    }
  }
}

// dQ[t] = scale Σ_s dS[t, s] K[s].
template <class T, int kDk32>
__global__ void __launch_bounds__(kWarps * 32)
    attention_grad_q_kernel(T* grad_q, const T* q, const T* k, const T* v, const T* grad_o, const acc_t<T>* lse,
                            const acc_t<T>* delta, Dims d, double scale_d) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int Dk = static_cast<int>(d.Dk), Dv = static_cast<int>(d.Dv);
  A* Qs = reinterpret_cast<A*>(smem);  // [kBr][Dk]      broadcasts
  A* dOs = Qs + kBr * Dk;              // [kBr][Dv]
  A* Ks = dOs + kBr * Dv;              // [kBc][Dk + 1]  lane c reads row c: padded
  A* Vs = Ks + kBc * (Dk + 1);         // [kBc][Dv + 1]
  const A scale = static_cast<A>(scale_d);
  const int64_t bh = blockIdx.y, b = bh / d.H, h = bh % d.H;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kBr;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  stage(Qs, Dk, q, d, b, h, r0, d.T, d.Dk, Dk, false);
  stage(dOs, Dv, grad_o, d, b, h, r0, d.T, d.Dv, Dv, false);
  A dq[kPerWarp][kDk32], row_lse[kPerWarp], row_delta[kPerWarp];
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr) {
    int64_t t = r0 + warp * kPerWarp + rr;
    row_lse[rr] = t < d.T ? lse[bh * d.T + t] : A(0);
    row_delta[rr] = t < d.T ? delta[bh * d.T + t] : A(0);
#pragma unroll
    for (int j = 0; j < kDk32; ++j) dq[rr][j] = A(0);
  }
  const int64_t r_last = std::min<int64_t>(d.T, r0 + kBr) - 1;
  const int64_t kv_end = d.off + r_last + 1;
  for (int64_t c0 = 0; c0 < kv_end; c0 += kBc) {
    __syncthreads();
    stage(Ks, Dk + 1, k, d, b, h, c0, d.Tk, d.Dk, Dk, true);
    stage(Vs, Dv + 1, v, d, b, h, c0, d.Tk, d.Dv, Dv, true);
    __syncthreads();
    const int64_t s = c0 + lane;
#pragma unroll
    for (int rr = 0; rr < kPerWarp; ++rr) {
      const int i = warp * kPerWarp + rr;
      const int64_t t = r0 + i;
      A ds = A(0);
      if (t < d.T && s <= d.off + t) {
        A dot = 0, dp = 0;
        for (int c = 0; c < Dk; ++c) dot += Qs[i * Dk + c] * Ks[lane * (Dk + 1) + c];
        for (int c = 0; c < Dv; ++c) dp += dOs[i * Dv + c] * Vs[lane * (Dv + 1) + c];
        ds = exp_a(dot * scale - row_lse[rr]) * (dp - row_delta[rr]);
      }
      for (int c = 0; c < kBc; ++c) {
        A dsc = __shfl_sync(0xffffffffu, ds, c);
#pragma unroll
        for (int j = 0; j < kDk32; ++j) {
          int dd = lane + 32 * j;
          if (dd < Dk) dq[rr][j] += dsc * Ks[c * (Dk + 1) + dd];
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr) {
    const int64_t t = r0 + warp * kPerWarp + rr;
    if (t >= d.T) continue;
#pragma unroll
    for (int j = 0; j < kDk32; ++j) {
      int dd = lane + 32 * j;
      if (dd < Dk) store(grad_q, row_q(d, b, t, h) * d.Dk + dd, dq[rr][j] * scale);
    }
  }
}

Dims dims_of(const Tensor& q, const Tensor& k, const Tensor& v) {
  Dims d{q.size(0), q.size(1), k.size(1), k.size(1) - q.size(1), q.size(2), q.size(3), v.size(3)};
  MT_CHECK(d.Dk >= 1 && d.Dk <= kMaxHeadDim && d.Dv >= 1 && d.Dv <= kMaxHeadDim,
           "causal_attention (CUDA): head dims Dk = {}, Dv = {}; the CUDA kernel supports 1..{}", d.Dk, d.Dv,
           kMaxHeadDim);
  MT_CHECK(d.B * d.H <= 65535, "causal_attention (CUDA): B * H = {} exceeds the grid's 65535", d.B * d.H);
  return d;
}

// Calls f(std::integral_constant<int, n>) with n = ceil(dim / 32) rounded up to 1, 2, 4 or 8.
template <class F> void dispatch_dim32(int64_t dim, F&& f) {
  if (dim <= 32) f(std::integral_constant<int, 1>{});
  else if (dim <= 64) f(std::integral_constant<int, 2>{});
  else if (dim <= 128) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

// The scalar kernels' launch: kWarps warps, `bytes` of shared memory.
template <class Kernel, class... Args>
void launch_scalar(Kernel kernel, LaunchDims grid, size_t bytes, cudaStream_t stream, const char* name, Args... args) {
  launch_with_shared(kernel, grid, kWarps * 32, bytes, stream, name, "causal_attention (CUDA): use f32 or smaller heads",
                     args...);
}

int64_t tiles(int64_t n, int tile) { return (n + tile - 1) / tile; }

}  // namespace

void causal_attention_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                              double scale, Tensor* row_max) {
  Dims d = dims_of(q, k, v);
  if (d.B * d.T * d.H == 0) return;
  if (attention_tensor_cores_apply(q, d.Dk, d.Dv)) return attention_tc_forward(o, lse, q, k, v, scale, row_max);
  dispatch_float_cuda(q.dtype(), "causal_attention", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    size_t bytes = sizeof(A) * static_cast<size_t>(kBr * d.Dk + kBc * (d.Dk + 1) + kBc * d.Dv);
    const LaunchDims grid(tiles(d.T, kBr), d.B * d.H);
    dispatch_dim32(d.Dv, [&](auto dv32) {
      launch_scalar(attention_forward_kernel<T, decltype(dv32)::value>, grid, bytes, stream_of(q),
                    "attention_forward_kernel", ptr<T>(o), ptr<A>(lse), row_max ? ptr<A>(*row_max) : nullptr,
                    static_cast<const T*>(ptr<T>(q)),
                    static_cast<const T*>(ptr<T>(k)), static_cast<const T*>(ptr<T>(v)), d, scale);
    });
  });
}

void causal_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                               const Tensor& lse, double scale) {
  Dims d = dims_of(q, k, v);
  if (d.B * d.H == 0) return;
  cudaStream_t s = stream_of(q);
  if (d.T == 0) {  // no query sees a key
    MT_CUDA_CHECK(cudaMemsetAsync(grad_k.raw_data(), 0, static_cast<size_t>(grad_k.nbytes()), s));
    MT_CUDA_CHECK(cudaMemsetAsync(grad_v.raw_data(), 0, static_cast<size_t>(grad_v.nbytes()), s));
    return;
  }
  dispatch_float_cuda(q.dtype(), "causal_attention_backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    Tensor delta = empty({d.B, d.H, d.T}, lse.dtype(), q.device());  // acc_t<T>, as lse
    int64_t rows = d.B * d.H * d.T;
    launch("attention_delta_kernel", attention_delta_kernel<T>, blocks_for(rows * 32), kThreads, 0, s, ptr<A>(delta),
           ptr<T>(grad_o), ptr<T>(o), d);
    if (attention_tensor_cores_apply(q, d.Dk, d.Dv))
      return attention_tc_backward(grad_q, grad_k, grad_v, grad_o, q, k, v, lse, delta, scale);
    const T* cq = ptr<T>(q);
    const T* ck = ptr<T>(k);
    const T* cv = ptr<T>(v);
    const T* cdo = ptr<T>(grad_o);
    const A* clse = ptr<A>(lse);
    const A* cdelta = ptr<A>(delta);
    // dK/dV's register tiles take the larger head dim for both (one instantiation per
    // size class instead of one per pair: a quarter of this file's compile time).
    dispatch_dim32(std::max(d.Dk, d.Dv), [&](auto d32) {
      size_t bytes = sizeof(A) * static_cast<size_t>(kBc * d.Dk + kBc * d.Dv + kBr * (d.Dk + 1) + kBr * (d.Dv + 1) +
                                                     2 * kBr);
      const LaunchDims grid(tiles(d.Tk, kBc), d.B * d.H);
      launch_scalar(attention_grad_kv_kernel<T, decltype(d32)::value, decltype(d32)::value>, grid, bytes, s,
                    "attention_grad_kv_kernel", ptr<T>(grad_k), ptr<T>(grad_v), cq, ck, cv, cdo, clse, cdelta, d,
                    scale);
    });
    dispatch_dim32(d.Dk, [&](auto dk32) {
      size_t bytes = sizeof(A) * static_cast<size_t>(kBr * d.Dk + kBr * d.Dv + kBc * (d.Dk + 1) + kBc * (d.Dv + 1));
      const LaunchDims grid(tiles(d.T, kBr), d.B * d.H);
      launch_scalar(attention_grad_q_kernel<T, decltype(dk32)::value>, grid, bytes, s, "attention_grad_q_kernel",
                    ptr<T>(grad_q), cq, ck, cv, cdo, clse, cdelta, d, scale);
    });
  });
}

}  // namespace moetrain::cuda
