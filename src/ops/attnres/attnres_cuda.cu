// CUDA twins of the AttnRes read kernels (attnres_cpu.cpp, same formulas): a
// block per token for the forward and the per-source gradients (sums over the
// model dim in double, the softmax over sources in double on one thread, as
// the CPU); the pseudo-query / norm gradients sum coef[n, m] V_m[n, d] over
// tokens in chunks (f64 partials, a thread per d), then the chunks in order, so
// every run gives the same bits. alpha and rstd are stored in acc_t<T> (f32 for
// bf16 sources). At most kMaxSources sources.
#include <algorithm>

#include "backend/cuda/kernel_utils.cuh"
#include "ops/attnres/attnres_kernels.h"

namespace moetrain::cuda {

namespace {

constexpr int kMaxSources = 64;
constexpr int64_t kTokensPerChunk = 64;

template <class T> struct Sources {
  const T* v[kMaxSources];
  T* grad[kMaxSources];  // backward: null where not needed
  int m = 0;
};

template <class T>
Sources<T> sources_of(const std::vector<const Tensor*>& sources, std::vector<Tensor>* grads = nullptr) {
  MT_CHECK(static_cast<int64_t>(sources.size()) <= kMaxSources, "attn_res: {} sources; the CUDA kernel takes at most {}",
           sources.size(), kMaxSources);
  Sources<T> s;
  s.m = static_cast<int>(sources.size());
  for (int i = 0; i < s.m; ++i) {
    s.v[i] = ptr<T>(*sources[static_cast<size_t>(i)]);
    s.grad[i] = grads && (*grads)[static_cast<size_t>(i)].defined() ? ptr<T>((*grads)[static_cast<size_t>(i)]) : nullptr;
  }
  return s;
}

// u[d] = proj[d] * norm[d] in the compute type, as the CPU's T product.
template <class T> __device__ __forceinline__ acc_t<T> u_at(const T* pw, const T* pn, int64_t d) {
  return load(pw, d) * load(pn, d);
}

template <class T>
__global__ void attn_res_forward_kernel(T* h, acc_t<T>* alpha, acc_t<T>* rstd, Sources<T> src, const T* pw,
                                        const T* pn, int64_t N, int64_t D, double eps) {
  using A = acc_t<T>;
  __shared__ double s[kMaxSources];
  __shared__ A a_sh[kMaxSources];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    for (int m = 0; m < src.m; ++m) {
      const T* v = src.v[m] + n * D;
      double sq = 0, dot = 0;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        double x = static_cast<double>(load(v, d));
        sq += x * x;
        dot += x * static_cast<double>(u_at(pw, pn, d));
      }
      sq = block_sum(sq);
      dot = block_sum(dot);
      if (threadIdx.x == 0) {
        double r = 1.0 / ::sqrt(sq / static_cast<double>(D) + eps);
        rstd[n * src.m + m] = static_cast<A>(r);
        s[m] = dot * r;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double smax = -INFINITY, z = 0;
      for (int m = 0; m < src.m; ++m) smax = max(smax, s[m]);
      for (int m = 0; m < src.m; ++m) z += (s[m] = ::exp(s[m] - smax));
      for (int m = 0; m < src.m; ++m) {
        a_sh[m] = static_cast<A>(s[m] / z);
        alpha[n * src.m + m] = a_sh[m];
      }
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      A acc = 0;
      for (int m = 0; m < src.m; ++m) acc += a_sh[m] * load(src.v[m] + n * D, d);
      store(h + n * D, d, acc);
    }
    __syncthreads();  // s and a_sh are rewritten for the next token
  }
}

// Per token: dp_m = <dh, V_m>, s_m = <V_m, u> r_m, ds_m = a_m (dp_m - Σ a dp);
// coef[n, m] = ds_m r_m; dV_m = a_m dh + ds_m r_m (u - V_m r_m s_m / D).
template <class T>
__global__ void attn_res_backward_kernel(acc_t<T>* coef, Sources<T> src, const T* dh, const T* pw, const T* pn,
                                         const acc_t<T>* alpha, const acc_t<T>* rstd, int64_t N, int64_t D) {
  using A = acc_t<T>;
  __shared__ double dp[kMaxSources], s[kMaxSources];
  __shared__ A ta[kMaxSources], tc[kMaxSources], tk[kMaxSources];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const T* g = dh + n * D;
    for (int m = 0; m < src.m; ++m) {
      const T* v = src.v[m] + n * D;
      double acc = 0, dot = 0;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        double x = static_cast<double>(load(v, d));
        acc += static_cast<double>(load(g, d)) * x;
        dot += x * static_cast<double>(u_at(pw, pn, d));
      }
      acc = block_sum(acc);
      dot = block_sum(dot);
      if (threadIdx.x == 0) {
        dp[m] = acc;
        s[m] = dot * static_cast<double>(rstd[n * src.m + m]);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double mean_dp = 0;
      for (int m = 0; m < src.m; ++m) mean_dp += static_cast<double>(alpha[n * src.m + m]) * dp[m];
      for (int m = 0; m < src.m; ++m) {
        double a = alpha[n * src.m + m], r = rstd[n * src.m + m];
        double ds = a * (dp[m] - mean_dp);
        coef[n * src.m + m] = static_cast<A>(ds * r);
        ta[m] = static_cast<A>(a);
        tc[m] = static_cast<A>(ds * r);
        tk[m] = static_cast<A>(r * s[m] / static_cast<double>(D));
      }
    }
    __syncthreads();
    for (int m = 0; m < src.m; ++m) {
      T* dv = src.grad[m];
      if (!dv) continue;
      const T* v = src.v[m] + n * D;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
        store(dv + n * D, d, ta[m] * load(g, d) + tc[m] * (u_at(pw, pn, d) - load(v, d) * tk[m]));
    }
    __syncthreads();
  }
}

// partial[chunk, d] = Σ over the chunk's tokens n, sources m of coef[n, m] V_m[n, d].
template <class T>
__global__ void attn_res_du_partial_kernel(double* partial, const acc_t<T>* coef, Sources<T> src, int64_t N,
                                           int64_t D) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, chunk = blockIdx.y;
  if (d >= D) return;
  const int64_t n0 = chunk * kTokensPerChunk, n1 = min(N, n0 + kTokensPerChunk);
  double du = 0;
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < src.m; ++m)
      du += static_cast<double>(coef[n * src.m + m]) * static_cast<double>(load(src.v[m] + n * D, d));
  partial[chunk * D + d] = du;
}

template <class T>
__global__ void attn_res_du_finish_kernel(T* dw, T* dn, const double* partial, const T* pw, const T* pn,
                                          int64_t chunks, int64_t D) {
  MT_GRID_LOOP(d, D) {
    double du = 0;
    for (int64_t c = 0; c < chunks; ++c) du += partial[c * D + d];
    if (dw) store(dw, d, static_cast<acc_t<T>>(du * static_cast<double>(load(pn, d))));
    if (dn) store(dn, d, static_cast<acc_t<T>>(du * static_cast<double>(load(pw, d))));
  }
}

unsigned token_blocks(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>(n, 1, int64_t{1} << 20)); }

}  // namespace

void attn_res_forward(Tensor& h, Tensor& alpha, Tensor& rstd, const std::vector<const Tensor*>& sources,
                      const Tensor& proj, const Tensor& norm, double eps) {
  const int64_t D = h.size(-1), N = h.numel() / std::max<int64_t>(D, 1);
  if (N == 0) return;
  dispatch_float_cuda(h.dtype(), "attn_res", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    launch("attn_res_forward_kernel", attn_res_forward_kernel<T>, token_blocks(N), kThreads, 0, stream_of(h), ptr<T>(h),
           ptr<A>(alpha), ptr<A>(rstd), sources_of<T>(sources), ptr<T>(proj), ptr<T>(norm), N, D, eps);
  });
}

void attn_res_backward(std::vector<Tensor>& grad_sources, Tensor* grad_proj, Tensor* grad_norm,
                       const Tensor& grad_h, const std::vector<const Tensor*>& sources, const Tensor& proj,
                       const Tensor& norm, const Tensor& alpha, const Tensor& rstd) {
  const int64_t D = grad_h.size(-1), N = grad_h.numel() / std::max<int64_t>(D, 1);
  const int64_t M = static_cast<int64_t>(sources.size());
  dispatch_float_cuda(grad_h.dtype(), "attn_res_backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    cudaStream_t s = stream_of(grad_h);
    Sources<T> src = sources_of<T>(sources, &grad_sources);
    Tensor coef = empty({std::max<int64_t>(N, 1), M}, alpha.dtype(), grad_h.device());
    if (N > 0)
      launch("attn_res_backward_kernel", attn_res_backward_kernel<T>, token_blocks(N), kThreads, 0, s, ptr<A>(coef),
             src, ptr<T>(grad_h), ptr<T>(proj), ptr<T>(norm), ptr<A>(alpha), ptr<A>(rstd), N, D);
    if (!grad_proj && !grad_norm) return;
    if (N == 0) {
      for (Tensor* t : {grad_proj, grad_norm})
        if (t) fill(t->raw_data(), t->dtype(), t->numel(), 0.0, t->device().index);
      return;
    }
    const int64_t chunks = (N + kTokensPerChunk - 1) / kTokensPerChunk;
    MT_CHECK(chunks <= 65535, "attn_res: {} tokens is beyond the CUDA kernel's {} chunks of {}", N, 65535,
             kTokensPerChunk);
    Tensor partial = empty({chunks, D}, DType::f64, grad_h.device());
    const LaunchDims grid((D + 127) / 128, chunks);
    launch("attn_res_du_partial_kernel", attn_res_du_partial_kernel<T>, grid, 128, 0, s, ptr<double>(partial),
           ptr<A>(coef), src, N, D);
    launch("attn_res_du_finish_kernel", attn_res_du_finish_kernel<T>, blocks_for(D), kThreads, 0, s,
           grad_proj ? ptr<T>(*grad_proj) : nullptr, grad_norm ? ptr<T>(*grad_norm) : nullptr, ptr<double>(partial),
           ptr<T>(proj), ptr<T>(norm), chunks, D);
  });
}

}  // namespace moetrain::cuda
