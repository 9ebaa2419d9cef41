#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/dropout/dropout_kernels.h"

namespace moetrain::cpu {

void dropout_apply(Tensor& out, const Tensor& in, double p, const Generator& gen, uint64_t first) {
  dispatch_float(in.dtype(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    const T* src = in.data<T>();
    T* dst = out.data<T>();
    T scale = static_cast<T>(1.0 / (1.0 - p));
    parallel_for(in.numel(), 4096, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        dst[i] = gen.uniform(first + static_cast<uint64_t>(i)) >= p ? src[i] * scale : T(0);
    });
  });
}

}  // namespace moetrain::cpu
