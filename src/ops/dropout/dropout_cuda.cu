// CUDA twin of dropout_apply (dropout_cpu.cpp): the same Philox4x32-10 counter
// stream as core/rng.cpp, so an element is kept or dropped on the GPU exactly
// as on the CPU for the same generator and offset.
#include "ops/dropout/dropout_kernels.h"

#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

namespace {

__device__ __forceinline__ double philox_uniform(uint64_t counter, uint64_t seed) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // 53 bits -> [0, 1), as Generator::uniform.
  uint64_t v = (static_cast<uint64_t>(c0) << 21) ^ (c1 >> 11);
  return static_cast<double>(v & ((uint64_t{1} << 53) - 1)) / 9007199254740992.0;
}

template <class T>
__global__ void dropout_kernel(T* out, const T* in, double p, acc_t<T> scale, uint64_t seed, uint64_t first,
                               int64_t n) {
  MT_GRID_LOOP(i, n) {
    bool keep = philox_uniform(first + static_cast<uint64_t>(i), seed) >= p;
    store(out, i, keep ? load(in, i) * scale : acc_t<T>(0));
  }
}

}  // namespace

void dropout_apply(Tensor& out, const Tensor& in, double p, const Generator& gen, uint64_t first) {
  int64_t n = in.numel();
  if (n == 0) return;
  dispatch_float_cuda(in.dtype(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    launch("dropout_kernel", dropout_kernel<T>, blocks_for(n), kThreads, 0, stream_of(in), ptr<T>(out), ptr<T>(in), p,
           static_cast<acc_t<T>>(1.0 / (1.0 - p)), gen.seed(), first, n);
  });
}

}  // namespace moetrain::cuda
