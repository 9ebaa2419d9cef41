// Kernel bodies written once for the GPU and the host (kda_simt.h,
// attention_tc.h). A body runs one thread block's work as a sequence of phases:
//   blk.each(f)       f(tid) for every thread tid of the block, then a barrier;
//   blk.each_warp(f)  f(warp) for every warp, then a barrier: warp-collective
//                     work (the tensor-core tile products of attention_tc.h),
//                     which every lane of the warp calls with the same arguments.
// On the GPU (DeviceBlock) each() is `f(threadIdx.x); __syncthreads();` and
// each_warp() `f(threadIdx.x / 32); __syncthreads();`; on the host (HostBlock)
// they are loops, so tests run the very bodies the kernels launch on the CPU.
// The rule that makes the host loop faithful to the GPU: within one phase a
// thread (warp) writes only what it owns and reads nothing that another thread
// (warp) writes in the same phase.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
// Before a body template: its host instantiation may call the device's each().
#define MT_SIMT_BODY _Pragma("nv_exec_check_disable")
#else
#define MT_HOST_DEVICE
#define MT_SIMT_BODY
#endif

namespace moetrain::simt {

// The host's block: each(f) runs f(0), ..., f(threads - 1) in turn.
struct HostBlock {
  int threads;
  template <class F>
  void each(F&& f) const {
    for (int tid = 0; tid < threads; ++tid) f(tid);
  }
  template <class F>
  void each_warp(F&& f) const {
    for (int w = 0; w < threads / 32; ++w) f(w);
  }
};

#if defined(__CUDACC__)
struct DeviceBlock {
  int threads;
  template <class F>
  __device__ void each(F&& f) const {
    f(static_cast<int>(threadIdx.x));
    __syncthreads();
  }
  template <class F>
  __device__ void each_warp(F&& f) const {
    f(static_cast<int>(threadIdx.x >> 5));
    __syncthreads();
  }
};
#endif

#if !defined(__CUDA_ARCH__)
// exp_a calls of this host thread. Tests count a body's exps: on the GPU they run
// on the special-function units at an eighth of the FMA rate, so they are what
// the bodies' factorisations save (tests/ops/kda/kda_simt_test.cpp bounds them).
inline thread_local long long host_exp_calls = 0;
#endif

MT_HOST_DEVICE inline float exp_a(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  ++host_exp_calls;
  return std::exp(x);
#endif
}
MT_HOST_DEVICE inline double exp_a(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  ++host_exp_calls;
  return std::exp(x);
#endif
}
MT_HOST_DEVICE inline float log_a(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  return std::log(x);
#endif
}

}  // namespace moetrain::simt
