// Kernel bodies written once for the GPU and the host (kda_simt.h,
// attention_tc.h). A body runs one thread block's work as a sequence of phases:
//   blk.each(f)       f(tid) for every thread tid of the block, then a barrier;
//   blk.each_warp(f)  f(warp) for every warp, then a barrier: warp-collective
//                     work (the tensor-core tile products of attention_tc.h),
//                     which every lane of the warp calls with the same arguments.
// Inside each_warp, lane-parallel work of the warp (all 32 lanes call these with
// the same arguments, the same number of times):
//   blk.lanes(f)      f(lane) for every lane of the warp;
//   blk.warp_sum(f), blk.warp_max(f)
//                     f(lane) for every lane, then its 32 values reduced by a
//                     butterfly (xor 16, 8, 4, 2, 1: __shfl_xor_sync on the GPU,
//                     the same additions on the host), the same bits in every lane.
//   blk.group_sum<G>(f, g), blk.group_max<G>(f, g)
//                     f(lane) for every lane, each group of G consecutive lanes
//                     (G a power of two, at most 32) reduced by the butterfly's
//                     steps xor G/2, ..., 1, then g(lane, value) for every lane:
//                     several rows reduced at once, one group of lanes a row
//                     (attention_tc.h's softmax). g may write what no f of the
//                     call reads.
// A lane writes only what it owns and reads nothing another lane writes within one
// lanes/warp_sum/warp_max call; across calls the warp is in step (the shuffles
// synchronise it on the GPU, and lanes() ends with __syncwarp). Code between the
// calls runs in every lane on the GPU but once per warp on the host, so it must
// give every lane the same values and read nothing that the very next call
// writes (a race the host cannot see; later calls are ordered after that one's
// synchronisation).
//   blk.warp_sync()   orders the warp's shared-memory accesses before it against
//                     those after it (__syncwarp on the GPU, nothing on the host):
//                     between a warp-collective store (an accumulator tile's store_acc)
//                     and lanes() that read what it stored.
// State a warp keeps across phases (attention_tc.h's accumulator fragments):
//   typename Blk::template PerWarp<X> st(blk);  st.at(w) is warp w's X.
// On the GPU every thread holds one X in registers and at(w) returns it (w is
// the thread's own warp); on the host, where warps run one after another, the
// holder keeps one X per warp. An X holding fragments must be indexed with
// compile-time indices only (unrolled loops), or nvcc moves it to local memory.
// On the GPU (DeviceBlock) each() is `f(threadIdx.x); __syncthreads();` and
// each_warp() `f(threadIdx.x / 32); __syncthreads();`; on the host (HostBlock)
// they are loops (natural, reversed or shuffled order: HostOrder below), so tests
// run the very bodies the kernels launch on the CPU.
// The rule that makes the host loop faithful to the GPU: within one phase a
// thread (warp) writes only what it owns and reads nothing that another thread
// (warp) writes in the same phase.
#pragma once

#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
// Before a body template: its host instantiation may call the device's each().
#define MT_SIMT_BODY _Pragma("nv_exec_check_disable")
// Before a loop over a fragment array (PerWarp below): unrolled on the GPU.
#define MT_UNROLL _Pragma("unroll")
#else
#define MT_HOST_DEVICE
#define MT_SIMT_BODY
#define MT_UNROLL
#endif

namespace moetrain::simt {

// The order in which the host runs one phase's threads (warps). On the GPU they
// run concurrently; a body that keeps the phase rule above gives the same bits in
// every order, one that breaks it (a missing barrier) depends on the order. The
// [simt] tests run every body in all three orders and require identical outputs
// (tests/ops/common/simt_test.cpp shows a planted race failing that).
enum class HostOrder { natural, reversed, shuffled };

// The host's block: each(f) runs f(tid) for every thread of the block in `order`:
// natural 0, 1, ..., threads - 1; reversed; or shuffled, a new permutation for
// every phase, drawn from `seed` and the phase's number (reproducible).
struct HostBlock {
  int threads;
  HostOrder order = HostOrder::natural;
  uint64_t seed = 0;
  mutable uint64_t phases = 0;  // phases run so far (shuffled: each draws its own permutation)

  template <class F>
  void each(F&& f) const {
    run(threads, f);
  }
  template <class F>
  void each_warp(F&& f) const {
    run(threads / 32, f);
  }
  template <class F>
  void lanes(F&& f) const {
    run(32, f);
  }
  void warp_sync() const {}
  template <class X>
  struct PerWarp {
    std::vector<X> x;
    explicit PerWarp(const HostBlock& blk) : x(static_cast<size_t>(blk.threads / 32)) {}
    X& at(int w) { return x[static_cast<size_t>(w)]; }
  };
  template <class F>
  float warp_sum(F&& f) const {
    return butterfly(f, [](float x, float y) { return x + y; });
  }
  template <class F>
  float warp_max(F&& f) const {
    return butterfly(f, [](float x, float y) { return std::fmax(x, y); });
  }
  template <int G, class F, class Gf>
  void group_sum(F&& f, Gf&& g) const {
    group<G>(f, g, [](float x, float y) { return x + y; });
  }
  template <int G, class F, class Gf>
  void group_max(F&& f, Gf&& g) const {
    group<G>(f, g, [](float x, float y) { return std::fmax(x, y); });
  }

 private:
  template <int G, class F, class Gf, class Op>
  void group(F& f, Gf& g, Op op) const {
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "a group is a power of two of lanes");
    float v[32], next[32];
    auto lane_value = [&](int lane) { v[lane] = f(lane); };
    run(32, lane_value);
    for (int off = G / 2; off > 0; off /= 2) {
      for (int i = 0; i < 32; ++i) next[i] = op(v[i], v[i ^ off]);
      for (int i = 0; i < 32; ++i) v[i] = next[i];
    }
    auto lane_result = [&](int lane) { g(lane, v[lane]); };
    run(32, lane_result);
  }
  // The GPU's butterfly: in step `off` lane i adds (maxes) lane i ^ off's value to
  // its own, v_i + v_(i^off) in that operand order, as `v += __shfl_xor_sync(.., v, off)`.
  template <class F, class Op>
  float butterfly(F& f, Op op) const {
    float v[32], next[32];
    auto lane_value = [&](int lane) { v[lane] = f(lane); };
    run(32, lane_value);
    for (int off = 16; off > 0; off /= 2) {
      for (int i = 0; i < 32; ++i) next[i] = op(v[i], v[i ^ off]);
      for (int i = 0; i < 32; ++i) v[i] = next[i];
    }
    return v[0];  // every lane's: x + y = y + x and max are exact in either order
  }
  template <class F>
  void run(int n, F& f) const {
    const uint64_t phase = phases++;
    if (order == HostOrder::natural) {
      for (int i = 0; i < n; ++i) f(i);
    } else if (order == HostOrder::reversed) {
      for (int i = n - 1; i >= 0; --i) f(i);
    } else {
      std::vector<int> perm(static_cast<size_t>(n));
      std::iota(perm.begin(), perm.end(), 0);
      uint64_t state = seed ^ (phase * 0x9e3779b97f4a7c15ull);
      for (int i = n - 1; i > 0; --i) {  // Fisher-Yates with splitmix64 draws
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(z % static_cast<uint64_t>(i + 1))]);
      }
      for (int i : perm) f(i);
    }
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
  template <class F>
  __device__ void lanes(F&& f) const {
    f(static_cast<int>(threadIdx.x & 31));
    __syncwarp();
  }
  __device__ void warp_sync() const { __syncwarp(); }
  template <class X>
  struct PerWarp {
    X x;
    __device__ explicit PerWarp(const DeviceBlock&) {}
    __device__ X& at(int) { return x; }
  };
  template <class F>
  __device__ float warp_sum(F&& f) const {
    float v = f(static_cast<int>(threadIdx.x & 31));
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
  }
  template <class F>
  __device__ float warp_max(F&& f) const {
    float v = f(static_cast<int>(threadIdx.x & 31));
    for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
  }
  template <int G, class F, class Gf>
  __device__ void group_sum(F&& f, Gf&& g) const {
    const int lane = static_cast<int>(threadIdx.x & 31);
    float v = f(lane);
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    g(lane, v);
    __syncwarp();
  }
  template <int G, class F, class Gf>
  __device__ void group_max(F&& f, Gf&& g) const {
    const int lane = static_cast<int>(threadIdx.x & 31);
    float v = f(lane);
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    g(lane, v);
    __syncwarp();
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
