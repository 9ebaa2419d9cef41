// What the CUDA kernels of src/ops/*/*_cuda.cu share: dtype dispatch (f32, f64,
// bf16 storage with f32 arithmetic), element loads and stores in the compute
// type, launch shapes, the tensor's stream, and warp/block reductions.
// Conventions: tensors are contiguous (the ops guarantee it); every kernel runs
// on the stream of its tensors' device; every launch goes through cuda::launch
// (launch.cuh), which checks its limits and reports a launch error by the kernel's name.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "backend/cuda/check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/runtime.h"
#include "core/dispatch.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

namespace moetrain::cuda {

using bf16_t = __nv_bfloat16;

// The arithmetic type of a storage type: bf16 computes in f32.
template <class T> struct AccOf { using type = T; };
template <> struct AccOf<bf16_t> { using type = float; };
template <class T> using acc_t = typename AccOf<T>::type;

template <class T> __device__ __forceinline__ acc_t<T> load(const T* p, int64_t i) { return p[i]; }
template <> __device__ __forceinline__ float load<bf16_t>(const bf16_t* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <class T> __device__ __forceinline__ void store(T* p, int64_t i, acc_t<T> v) { p[i] = v; }
template <> __device__ __forceinline__ void store<bf16_t>(bf16_t* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

// Floating dtypes of the CUDA kernels: f32, f64 and bf16.
template <class F>
decltype(auto) dispatch_float_cuda(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16_t{});
    default: MT_THROW("{}: expected a floating tensor (f32, f64 or bf16), got {}", op, t);
  }
}

template <class T> T* ptr(const Tensor& t) { return static_cast<T*>(t.raw_data()); }

inline cudaStream_t stream_of(const Tensor& t) { return stream(t.device().index); }

constexpr int kThreads = 256;
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b < 65535LL * 32 ? b : 65535LL * 32);  // grid-stride loops cover the rest
}

// for (i = global thread; i < n; i += grid size)
#define MT_GRID_LOOP(i, n)                                                                       \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);         \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <class A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class A> __device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets it.
template <class A> __device__ A block_sum(A v) {
  __shared__ A partial[32];
  __syncthreads();  // partial may still be read by a previous call
  v = warp_sum(v);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  int nwarps = blockDim.x >> 5;
  A r = lane < nwarps ? partial[lane] : A(0);
  return warp_sum(r);
}
template <class A> __device__ A block_max(A v) {
  __shared__ A partial[32];
  __syncthreads();
  v = warp_max(v);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  int nwarps = blockDim.x >> 5;
  A r = lane < nwarps ? partial[lane] : partial[0];
  return warp_max(r);
}

// Σ partial[0..parts) by one block in a fixed order: the second pass of a
// two-pass sum whose first pass wrote one double per block (the same bits every
// run, unlike atomics). Every thread gets the sum.
__device__ inline double sum_partials(const double* partial, int64_t parts) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < parts; i += blockDim.x) acc += partial[i];
  return block_sum(acc);
}

// out[0] = Σ partial[0..parts), as T; launch with one block.
template <class T> __global__ void store_sum_of_partials(T* out, const double* partial, int64_t parts) {
  double s = sum_partials(partial, parts);
  if (threadIdx.x == 0) store(out, 0, static_cast<acc_t<T>>(s));
}

}  // namespace moetrain::cuda
