// CUDA twins of the depthwise causal conv kernels (conv_cpu.cpp): the forward
// and dx give a thread each (row, channel) and add the taps in the CPU's order;
// dw sums dy x over all (b, t) rows: chunks of rows in parallel (f64 partials
// per chunk, a thread per channel), then the chunks in order, so every run
// gives the same bits. Kernels up to kMaxTaps taps. With silu (conv_silu.h) the
// forward applies SiLU to its sum and the backward kernels recompute the sum where
// they need SiLU's derivative (W taps a point), so the fused op launches no kernel
// the plain conv does not.
#include <algorithm>
#include <type_traits>

#include "backend/cuda/kernel_utils.cuh"
#include "ops/conv/conv_kernels.h"
#include "ops/conv/conv_silu_simt.h"

namespace moetrain::cuda {

namespace {

constexpr int kMaxTaps = 16;
constexpr int64_t kRowsPerChunk = 128;

// conv(x) at (b, t, c), in the compute type: the forward's sum, in its order. TX is
// x's storage type: T, or bf16 under an f32 weight (the cast fused: conv_silu.h).
template <class TX, class T>
__device__ __forceinline__ acc_t<T> conv_at(const TX* x, const T* w, int64_t b, int64_t t, int64_t c, int64_t Tn,
                                             int64_t C, int64_t W) {
  acc_t<T> acc = 0;
  for (int64_t i = 0; i < W; ++i) {
    int64_t s = t - (W - 1) + i;
    if (s >= 0) acc += load(w, c * W + i) * load(x, (b * Tn + s) * C + c);
  }
  return acc;
}

// The conv's upstream gradient at (b, t, c): dy, or with silu dy silu'(conv(x)), the
// conv recomputed (conv_silu_simt.h), so no kernel writes it between the two.
template <class TX, class T>
__device__ __forceinline__ acc_t<T> conv_upstream(const T* dy, const TX* x, const T* w, bool silu, int64_t b,
                                                  int64_t t, int64_t c, int64_t Tn, int64_t C, int64_t W) {
  const acc_t<T> g = load(dy, (b * Tn + t) * C + c);
  return silu ? g * simt::conv_silu_derivative(conv_at(x, w, b, t, c, Tn, C, W)) : g;
}

template <class TX, class T>
__global__ void conv_forward_kernel(T* y, const TX* x, const T* w, int64_t B, int64_t Tn, int64_t C, int64_t W,
                                    bool silu) {
  MT_GRID_LOOP(e, B * Tn * C) {
    int64_t c = e % C, bt = e / C, b = bt / Tn, t = bt % Tn;
    const acc_t<T> acc = conv_at(x, w, b, t, c, Tn, C, W);
    store(y, e, silu ? simt::conv_silu_value(acc) : acc);
  }
}

template <class TX, class T>
__global__ void conv_grad_x_kernel(TX* dx, const T* dy, const TX* x, const T* w, int64_t B, int64_t Tn, int64_t C,
                                   int64_t W, bool silu) {
  using A = acc_t<T>;
  MT_GRID_LOOP(e, B * Tn * C) {
    int64_t c = e % C, bs = e / C, b = bs / Tn, s = bs % Tn;
    A acc = 0;
    for (int64_t i = 0; i < W; ++i) {
      int64_t t = s + W - 1 - i;
      if (t < Tn) acc += load(w, c * W + i) * conv_upstream(dy, x, w, silu, b, t, c, Tn, C, W);
    }
    store(dx, e, acc);
  }
}

// partial[chunk, c, i] = Σ over rows r of the chunk of dy[r, c] x[r - W + 1 + i, c] (same sequence).
template <class TX, class T>
__global__ void conv_grad_w_partial_kernel(double* partial, const T* dy, const TX* x, const T* w, int64_t B,
                                           int64_t Tn, int64_t C, int64_t W, bool silu) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, chunk = blockIdx.y;
  if (c >= C) return;
  double acc[kMaxTaps] = {};
  const int64_t r0 = chunk * kRowsPerChunk, r1 = min(B * Tn, r0 + kRowsPerChunk);
  for (int64_t r = r0; r < r1; ++r) {
    int64_t b = r / Tn, t = r % Tn;
    double g = static_cast<double>(conv_upstream(dy, x, w, silu, b, t, c, Tn, C, W));
    for (int64_t i = 0; i < W; ++i) {
      int64_t s = t - W + 1 + i;
      if (s >= 0) acc[i] += g * static_cast<double>(load(x, (b * Tn + s) * C + c));
    }
  }
  for (int64_t i = 0; i < W; ++i) partial[(chunk * C + c) * W + i] = acc[i];
}

template <class T> __global__ void conv_grad_w_finish_kernel(T* dw, const double* partial, int64_t chunks, int64_t CW) {
  MT_GRID_LOOP(e, CW) {
    double s = 0;
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * CW + e];
    store(dw, e, static_cast<acc_t<T>>(s));
  }
}

// f(TX{}, T{}): T the weight's (and y's) type, TX x's: T, or bf16 under f32 weights.
template <class F> void dispatch_conv_types(const Tensor& x, const Tensor& w, const char* op, F&& f) {
  dispatch_float_cuda(w.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>)
      if (x.dtype() == DType::bf16) return f(bf16_t{}, float{});
    return f(T{}, T{});
  });
}

}  // namespace

void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w, bool silu) {
  int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
  if (x.numel() == 0) return;
  dispatch_conv_types(x, w, "causal_conv1d", [&](auto x_tag, auto tag) {
    using TX = decltype(x_tag);
    using T = decltype(tag);
    launch("conv_forward_kernel", conv_forward_kernel<TX, T>, blocks_for(x.numel()), kThreads, 0, stream_of(x),
           ptr<T>(y), ptr<TX>(x), ptr<T>(w), B, Tn, C, W, silu);
  });
}

void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                            const Tensor& w, bool silu) {
  int64_t B = x.size(0), Tn = x.size(1), C = x.size(2), W = w.size(1);
  dispatch_conv_types(x, w, "causal_conv1d_backward", [&](auto x_tag, auto tag) {
    using TX = decltype(x_tag);
    using T = decltype(tag);
    cudaStream_t s = stream_of(x);
    if (grad_x && x.numel() > 0)
      launch("conv_grad_x_kernel", conv_grad_x_kernel<TX, T>, blocks_for(x.numel()), kThreads, 0, s, ptr<TX>(*grad_x),
             ptr<T>(grad_y), ptr<TX>(x), ptr<T>(w), B, Tn, C, W, silu);
    if (grad_w) {
      if (B * Tn == 0) return fill(grad_w->raw_data(), grad_w->dtype(), grad_w->numel(), 0.0, x.device().index);
      MT_CHECK(W <= kMaxTaps, "causal_conv1d: {} taps; the CUDA kernel takes at most {}", W, kMaxTaps);
      int64_t chunks = (B * Tn + kRowsPerChunk - 1) / kRowsPerChunk;
      MT_CHECK(chunks <= 65535, "causal_conv1d: {} rows is beyond the CUDA kernel's {} chunks of {}", B * Tn, 65535,
               kRowsPerChunk);
      Tensor partial = empty({chunks, C, W}, DType::f64, x.device());
      const LaunchDims grid((C + 127) / 128, chunks);
      launch("conv_grad_w_partial_kernel", conv_grad_w_partial_kernel<TX, T>, grid, 128, 0, s,
             ptr<double>(partial), ptr<T>(grad_y), ptr<TX>(x), ptr<T>(w), B, Tn, C, W, silu);
      launch("conv_grad_w_finish_kernel", conv_grad_w_finish_kernel<T>, blocks_for(C * W), kThreads, 0, s,
             ptr<T>(*grad_w), ptr<double>(partial), chunks, C * W);
    }
  });
}

}  // namespace moetrain::cuda
