#include "ops/elementwise/convert.h"

#include "autograd/node.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/runtime.h"
#include "core/dispatch.h"
#include "ops/view/view.h"

namespace moetrain {

namespace cpu {
void convert(Tensor& out, const Tensor& x) {
  dispatch_all(x.dtype(), [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_all(out.dtype(), [&](auto out_tag) {
      using Out = decltype(out_tag);
      const In* src = x.data<In>();
      Out* dst = out.data<Out>();
      parallel_for(x.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          if constexpr (std::is_same_v<In, Out>) dst[i] = src[i];
          else if constexpr (std::is_same_v<Out, bf16>) dst[i] = bf16::from_float(static_cast<float>(to_double(src[i])));
          else if constexpr (std::is_same_v<In, bf16>) dst[i] = static_cast<Out>(src[i].to_float());
          else dst[i] = static_cast<Out>(src[i]);
        }
      });
    });
  });
}
}  // namespace cpu

Tensor Tensor::clone() const {
  Tensor y = empty(shape(), dtype(), device());
  copy_(y, *this);
  return record("clone", y, {*this}, [](const Tensor& g) { return Grads{g}; });
}

Tensor Tensor::to(DType target) const {
  if (target == dtype()) return *this;
  Tensor y = empty(shape(), target, device());
  if (is_cuda()) cuda::convert(y.raw_data(), target, raw_data(), dtype(), numel(), device().index);
  else cpu::convert(y, *this);
  if (!is_floating(target) || !is_floating(dtype())) return y;
  DType source = dtype();
  return record("to_dtype", y, {*this}, [source](const Tensor& g) { return Grads{g.to(source)}; });
}

Tensor Tensor::to(Device target) const {
  if (target == device()) return *this;
  Tensor y = empty(shape(), dtype(), target);
  copy_(y, *this);
  Device source = device();
  return record("to_device", y, {*this}, [source](const Tensor& g) { return Grads{g.to(source)}; });
}

Tensor Tensor::contiguous() const {
  if (impl().offset == 0 && impl().storage->nbytes() == nbytes()) return *this;
  return clone();
}

Tensor Tensor::reshape(const std::vector<int64_t>& dims) const { return moetrain::reshape(*this, dims); }

}  // namespace moetrain
