// Device helpers shared by the CUDA kernels of the norm, softmax, reduce, situ,
// topk and attention families (on top of backend/cuda/kernel_utils.cuh): math in
// the compute type (float or double), the "argmax order" of max and topk, and
// scratch tensors on a tensor's device.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/kernel_utils.cuh"
#include "backend/cuda/launch.cuh"

namespace moetrain::cuda {

// exp/log/tanh in the compute type: the float versions for f32 and bf16, the
// double ones for f64 (device overloads from the CUDA math library).
template <class A> __device__ __forceinline__ A exp_a(A x) { return exp(x); }
template <> __device__ __forceinline__ float exp_a<float>(float x) { return expf(x); }
template <class A> __device__ __forceinline__ A log_a(A x) { return log(x); }
template <> __device__ __forceinline__ float log_a<float>(float x) { return logf(x); }
template <class A> __device__ __forceinline__ A tanh_a(A x) { return tanh(x); }
template <> __device__ __forceinline__ float tanh_a<float>(float x) { return tanhf(x); }
template <class A> __device__ __forceinline__ A sigmoid_a(A x) { return A(1) / (A(1) + exp_a(-x)); }
template <class A> __device__ __forceinline__ A neg_inf() { return -INFINITY; }
template <> __device__ __forceinline__ double neg_inf<double>() { return -static_cast<double>(INFINITY); }

// The order of max_dim and topk (as their CPU kernels): NaN first, then larger
// values, then the lower index. max_dim's result is the first element in this
// order (the first NaN, else the first occurrence of the maximum), topk's the
// first k. idx < 0 marks "no candidate", which comes after everything.
template <class A> struct Ranked {
  A value;
  int64_t idx;
};
template <class A> __device__ __forceinline__ bool ranks_before(const Ranked<A>& a, const Ranked<A>& b) {
  if (a.idx < 0) return false;
  if (b.idx < 0) return true;
  bool na = a.value != a.value, nb = b.value != b.value;
  if (na != nb) return na;
  if (!na && a.value != b.value) return a.value > b.value;
  return a.idx < b.idx;
}
template <class A> __device__ __forceinline__ Ranked<A> warp_first(Ranked<A> r) {
  for (int o = 16; o > 0; o >>= 1) {
    Ranked<A> other{__shfl_xor_sync(0xffffffffu, r.value, o), __shfl_xor_sync(0xffffffffu, r.idx, o)};
    if (ranks_before(other, r)) r = other;
  }
  return r;
}
// First in the order over the block (blockDim.x a multiple of 32); every thread gets it.
template <class A> __device__ Ranked<A> block_first(Ranked<A> r) {
  __shared__ A values[32];
  __shared__ int64_t idxs[32];
  __syncthreads();  // the arrays may still be read by a previous call
  r = warp_first(r);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    values[warp] = r.value;
    idxs[warp] = r.idx;
  }
  __syncthreads();
  int nwarps = blockDim.x >> 5;
  Ranked<A> w = lane < nwarps ? Ranked<A>{values[lane], idxs[lane]} : Ranked<A>{A(0), -1};
  return warp_first(w);
}

// device_attribute (launch.cuh): an attribute of this thread's device, asked of CUDA
// once per device (no cudaGetDevice per call).

// The opt-in shared memory per block of the current device, in bytes.
inline int max_shared_bytes() { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin); }

// Whether the current device has the tensor cores of wmma's bf16 and TF32 tiles (sm_80+).
inline bool has_tensor_cores() { return device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8; }

// Launches kernel<<<grid, threads, bytes, stream>>>(args...) with `bytes` of
// dynamic shared memory through cuda::launch (backend/cuda/launch.cuh: the limits,
// the opt-in above 48 KiB); a limit's error names the kernel and ends with `what`,
// what the caller can change.
template <class... KArgs>
void launch_with_shared(void (*kernel)(KArgs...), LaunchDims grid, int threads, size_t bytes, cudaStream_t stream,
                        const char* name, const char* what, std::type_identity_t<KArgs>... args) {
  launch_advised(name, what, kernel, grid, threads, static_cast<int64_t>(bytes), stream, args...);
}

}  // namespace moetrain::cuda
