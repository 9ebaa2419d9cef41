#include "core/tensor.h"

#include <algorithm>
#include <cstring>

#include "core/dispatch.h"
#include "core/grad_mode.h"
#include "core/memory.h"
#include "core/parallel.h"

namespace moetrain {

namespace {

std::shared_ptr<TensorImpl> make_impl(const Shape& shape, DType dtype, Device device) {
  auto impl = std::make_shared<TensorImpl>();
  int64_t nbytes = 0;
  if (__builtin_mul_overflow(shape.numel(), static_cast<int64_t>(dtype_size(dtype)), &nbytes))
    throw OutOfMemoryError(fmt::format("a tensor of shape {} {} would need more than 2^63 bytes", shape, dtype));
  try {
    impl->storage = std::make_shared<Storage>(nbytes, device);
  } catch (const OutOfMemoryError& e) {  // the allocator names the bytes; add what they were for
    throw OutOfMemoryError(fmt::format("{} (for a tensor of shape {} {})", e.what(), shape, dtype));
  }
  impl->shape = shape;
  impl->dtype = dtype;
  return impl;
}

void check_inplace_allowed(const Tensor& t, const char* op) {
  MT_CHECK(!(t.requires_grad() && autograd::grad_enabled()),
           "{}: in-place write into {} which requires grad while grad mode is on; "
           "wrap the update in NoGradGuard (optimizer steps) or use the out-of-place op",
           op, describe(t));
}

}  // namespace

Tensor empty(const Shape& shape, DType dtype, Device device) { return Tensor(make_impl(shape, dtype, device)); }

Tensor zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_(t, 0.0);
  return t;
}

Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_(t, value);
  return t;
}

Tensor arange(int64_t n, DType dtype, Device device) {
  Tensor t = empty({n}, dtype, kCpu);
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    for (int64_t i = 0; i < n; ++i) p[i] = from_double<T>(static_cast<double>(i));
  });
  return device.is_cpu() ? t : t.to(device);
}

Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device()); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }

Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype) {
  MT_CHECK(static_cast<int64_t>(values.size()) == shape.numel(),
           "from_vector: {} values for shape {} ({} elements)", values.size(), shape, shape.numel());
  Tensor t = empty(shape, dtype);
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = from_double<T>(values[i]);
  });
  return t;
}

Tensor alias(const Tensor& t, const Shape& shape, int64_t extra_offset) {
  MT_ASSERT(extra_offset >= 0 && extra_offset + shape.numel() <= t.impl().storage->nbytes() / dtype_size(t.dtype()) - t.impl().offset,
            "alias {} at +{} does not fit the storage of {}", shape, extra_offset, describe(t));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = t.impl().storage;
  impl->offset = t.impl().offset + extra_offset;
  impl->shape = shape;
  impl->dtype = t.dtype();
  return Tensor(std::move(impl));
}

Tensor Tensor::detach() const { return alias(*this, shape()); }

Tensor& Tensor::set_requires_grad(bool on) {
  MT_CHECK(!on || is_floating(dtype()), "set_requires_grad: {} is not a floating tensor; only f32/f64/bf16 "
           "tensors can have gradients", describe(*this));
  MT_CHECK(is_leaf(), "set_requires_grad on {} which is the output of an op; only leaves can be marked",
           describe(*this));
  impl().requires_grad = on;
  return *this;
}

template <class T>
T Tensor::item() const {
  MT_CHECK(numel() == 1, "item() needs a one-element tensor, got {}", describe(*this));
  Tensor host = is_cpu() ? *this : to(kCpu);
  // Read in the tensor's own dtype: integers beyond 2^53 stay exact.
  return dispatch_all(dtype(), [&](auto tag) -> T {
    using S = decltype(tag);
    S v = *host.data<S>();
    if constexpr (std::is_same_v<S, bf16>) return static_cast<T>(v.to_float());
    else return static_cast<T>(v);
  });
}
template float Tensor::item<float>() const;
template double Tensor::item<double>() const;
template int32_t Tensor::item<int32_t>() const;
template int64_t Tensor::item<int64_t>() const;

std::vector<double> Tensor::to_vector() const {
  Tensor host = is_cpu() ? *this : to(kCpu);
  std::vector<double> out(static_cast<size_t>(numel()));
  dispatch_all(dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = host.data<T>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = to_double(p[i]);
  });
  return out;
}

void fill_(const Tensor& t, double value) {
  check_inplace_allowed(t, "fill_");
  if (t.is_cuda()) return cuda::fill(t.raw_data(), t.dtype(), t.numel(), value, t.device().index);
  dispatch_all(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T v = from_double<T>(value);
    T* p = t.data<T>();
    int64_t n = t.numel();
    if (value == 0.0) {
      cpu::parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) { std::memset(static_cast<void*>(p + b), 0, (e - b) * sizeof(T)); });
    } else {
      cpu::parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) { std::fill(p + b, p + e, v); });
    }
  });
}

void copy_(const Tensor& dst, const Tensor& src) {
  check_inplace_allowed(dst, "copy_");
  MT_CHECK(dst.shape() == src.shape() && dst.dtype() == src.dtype(), "copy_: destination {} but source {}",
           describe(dst), describe(src));
  int64_t nb = src.nbytes();
  if (nb == 0) return;
  if (dst.is_cpu() && src.is_cpu()) {
    char* d = static_cast<char*>(dst.raw_data());
    const char* s = static_cast<const char*>(src.raw_data());
    bool overlap = d < s + nb && s < d + nb;
    if (overlap) std::memmove(d, s, nb);
    else cpu::parallel_for(nb, 1 << 18, [&](int64_t b, int64_t e) { std::memcpy(d + b, s + b, e - b); });
  } else if (dst.is_cuda() && src.is_cpu()) {
    cuda::copy_host_to_device(dst.raw_data(), src.raw_data(), nb, dst.device().index);
  } else if (dst.is_cpu() && src.is_cuda()) {
    cuda::copy_device_to_host(dst.raw_data(), src.raw_data(), nb, src.device().index);
  } else {
    MT_CHECK(dst.device() == src.device(), "copy_ between {} and {}: copy through the host", dst.device(),
             src.device());
    cuda::copy_device_to_device(dst.raw_data(), src.raw_data(), nb, dst.device().index);
  }
}

void move_to_device_(const Tensor& t, Device device) {
  if (!t.defined() || t.device() == device) return;
  TensorImpl& impl = t.impl();
  MT_CHECK(t.is_leaf() && impl.offset == 0 && impl.storage->nbytes() == t.nbytes() && impl.storage.use_count() == 1,
           "move_to_device_: {} is a view or shares its storage; only whole leaves move in place", describe(t));
  Tensor moved = t.detach().to(device);
  impl.storage = moved.impl().storage;
  if (impl.grad) impl.grad.reset();  // a gradient on the old device would not match
}

void convert_dtype_(const Tensor& t, DType dtype) {
  if (!t.defined() || t.dtype() == dtype) return;
  TensorImpl& impl = t.impl();
  MT_CHECK(t.is_leaf() && impl.offset == 0 && impl.storage->nbytes() == t.nbytes() && impl.storage.use_count() == 1,
           "convert_dtype_: {} is a view or shares its storage; only whole leaves change dtype in place", describe(t));
  Tensor converted = t.detach().to(dtype);
  impl.storage = converted.impl().storage;
  impl.dtype = dtype;
  if (impl.grad) impl.grad.reset();  // a gradient of the old dtype would not match
}

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined tensor";
  return fmt::format("{}{} {}", t.dtype(), t.shape(), t.device());
}

}  // namespace moetrain
