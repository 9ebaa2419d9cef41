#include <type_traits>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_rows.h"
#include "ops/dropout/dropout_kernels.h"

namespace moetrain::cpu {

// dst = src scale where the element's uniform draw is >= p, else 0. bf16 (its own
// path): each value widened, the f32 product rounded once, the bits of the widening
// route.
void dropout_apply(Tensor& out, const Tensor& in, double p, const Generator& gen, uint64_t first) {
  MT_CHECK(out.dtype() == in.dtype(), "dropout: out {} and in {} differ in dtype", describe(out), describe(in));
  dispatch_float_or_bf16(in.dtype(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    using C = std::conditional_t<std::is_same_v<T, bf16>, float, T>;  // the arithmetic type
    const T* src = in.data<T>();
    T* dst = out.data<T>();
    const C scale = static_cast<C>(1.0 / (1.0 - p));
    parallel_for(in.numel(), 4096, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const C v = gen.uniform(first + static_cast<uint64_t>(i)) >= p ? widened_value(src[i]) * scale : C(0);
        if constexpr (std::is_same_v<T, bf16>)
          dst[i] = bf16::from_float(v);
        else
          dst[i] = v;
      }
    });
  });
}

}  // namespace moetrain::cpu
