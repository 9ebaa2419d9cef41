// Tensor: a shared handle to (storage, element offset, shape, dtype) plus the
// autograd fields. Layout is always contiguous row-major: views are reshapes and
// ranges of leading rows (they share storage); permute, transpose and general
// slices copy. Copying a Tensor copies the handle, never the data (clone() does).
//
// Autograd fields: requires_grad, the node that produced the tensor (grad_fn,
// output_nr) and the accumulated gradient of a leaf. See src/autograd/.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/shape.h"
#include "core/storage.h"

namespace moetrain {

namespace autograd {
struct Node;
}

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // in elements of dtype
  Shape shape;
  DType dtype = DType::f32;

  bool requires_grad = false;
  std::shared_ptr<autograd::Node> grad_fn;  // null for leaves and for tensors without grad
  int output_nr = 0;                        // which output of grad_fn this is
  std::shared_ptr<TensorImpl> grad;         // accumulated gradient (leaves)
};

class Tensor;
using Tensors = std::vector<Tensor>;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  int dim() const { return impl().shape.ndim(); }
  int64_t size(int64_t d) const { return impl().shape.size(d); }
  int64_t numel() const { return impl().shape.numel(); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_cpu() const { return device().is_cpu(); }
  int64_t nbytes() const { return numel() * dtype_size(dtype()); }

  // Typed pointer to the first element; the dtype must match T.
  template <class T> T* data() const {
    MT_CHECK(dtype() == dtype_v<T>, "tensor of dtype {} accessed as {}", dtype(), dtype_v<T>);
    return static_cast<T*>(raw_data());
  }
  void* raw_data() const {
    return static_cast<char*>(impl().storage->data()) + impl().offset * dtype_size(dtype());
  }
  // The single element of a one-element tensor (any dtype, any device) as T.
  template <class T> T item() const;
  // All elements converted to double, copied to the host (tests, logging).
  std::vector<double> to_vector() const;

  // --- views and copies (autograd-aware; defined in src/ops/) ---
  Tensor reshape(const std::vector<int64_t>& dims) const;  // one extent may be -1
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  Tensor clone() const;
  // A compact copy owning exactly its elements when this tensor is a view into a
  // larger storage (e.g. rows sliced from a big buffer); otherwise *this.
  Tensor contiguous() const;

  // --- autograd ---
  bool requires_grad() const { return impl().requires_grad; }
  // Marks a leaf as a parameter/input whose gradient is accumulated in grad().
  Tensor& set_requires_grad(bool on = true);
  Tensor grad() const { return Tensor(impl().grad); }
  void zero_grad() const { impl_->grad.reset(); }
  void set_grad(const Tensor& g) const { impl_->grad = g.impl_; }
  bool is_leaf() const { return impl().grad_fn == nullptr; }
  // Same storage, no autograd history.
  Tensor detach() const;
  // Backpropagates from this tensor: a scalar (grad 1) or with the upstream gradient.
  void backward(const Tensor& grad = {}, bool retain_graph = false) const;

  TensorImpl& impl() const {
    MT_CHECK(impl_ != nullptr, "use of an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same_storage(const Tensor& o) const { return impl().storage == o.impl().storage; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// --- factories (host or device; contents as named) ---
Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = kCpu);
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = kCpu);
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = kCpu);
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = kCpu);
Tensor arange(int64_t n, DType dtype = DType::i64, Device device = kCpu);
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
// A tensor holding a copy of `values` (converted to dtype) with the given shape.
Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype = DType::f32);
template <class T> Tensor from_span(std::span<const T> values, const Shape& shape) {
  MT_CHECK(static_cast<int64_t>(values.size()) == shape.numel(), "from_span: {} values for shape {} ({} elements)",
           values.size(), shape, shape.numel());
  Tensor t = empty(shape, dtype_v<T>);
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

// View of a tensor as another shape over the same storage (no autograd; the
// op `reshape` in src/ops/view/view.h is the differentiable form).
Tensor alias(const Tensor& t, const Shape& shape, int64_t extra_offset = 0);

// In-place helpers for optimizer state and gradient buffers. They refuse tensors
// that take part in a graph while grad mode is on.
void fill_(const Tensor& t, double value);
void copy_(const Tensor& dst, const Tensor& src);  // same shape and dtype, any devices

std::string describe(const Tensor& t);  // "f32[3, 4] cpu"
// Moves a leaf's elements to `device` in place: every handle to this tensor (a
// model's member and its ParameterList entry) sees the new device. For whole
// leaves (parameters, optimizer moments) that no view shares; checked.
void move_to_device_(const Tensor& t, Device device);
// Converts a leaf's elements to `dtype` in place (bf16 rounds to nearest even),
// the same way: every handle sees the new dtype; a gradient is dropped. For whole
// leaves (mixed precision turns parameters into bf16); checked.
void convert_dtype_(const Tensor& t, DType dtype);

}  // namespace moetrain
