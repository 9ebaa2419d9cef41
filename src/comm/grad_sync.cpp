// Bucketed gradient all-reduce; see grad_sync.h. Sums are taken in the bucket
// dtype (f32 for f32 and bf16 grads, f64 for f64) and scaled there, so a bf16
// grad is rounded once.
#include "comm/grad_sync.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>
#include <vector>

#include "autograd/grad_mode.h"
#include "core/dispatch.h"
#include "ops/elementwise.h"
#include "ops/view.h"

namespace moetrain::comm {

namespace {

DType bucket_dtype(const NamedParameter& p) {
  switch (p.tensor.dtype()) {
    case DType::f32:
    case DType::bf16: return DType::f32;
    case DType::f64: return DType::f64;
    default:
      MT_THROW("all_reduce_grads: parameter '{}' is {}; gradients are synchronised for f32, bf16 and f64 parameters",
               p.name, describe(p.tensor));
  }
}

// Copies the grad of p (zeros when it has none) into dst, converting bf16.
template <class T>
void pack(T* dst, const NamedParameter& p) {
  Tensor g = p.tensor.grad();
  const int64_t n = p.tensor.numel();
  if (!g.defined()) {
    std::fill(dst, dst + n, T(0));
  } else if (g.dtype() == DType::bf16) {
    const bf16* s = g.data<bf16>();
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(s[i].to_float());
  } else {
    std::memcpy(dst, g.data<T>(), static_cast<size_t>(n) * sizeof(T));
  }
}

// Writes scale * src back into the grad of p (creating it when absent).
template <class T>
void unpack(const T* src, const NamedParameter& p, double scale) {
  Tensor g = p.tensor.grad();
  if (!g.defined()) {
    g = empty(p.tensor.shape(), p.tensor.dtype());
    p.tensor.set_grad(g);
  }
  const int64_t n = p.tensor.numel();
  const T s = static_cast<T>(scale);
  if (g.dtype() == DType::bf16) {
    bf16* d = g.data<bf16>();
    for (int64_t i = 0; i < n; ++i) d[i] = bf16::from_float(static_cast<float>(src[i] * s));
  } else {
    T* d = g.data<T>();
    for (int64_t i = 0; i < n; ++i) d[i] = src[i] * s;
  }
}

// A bucket of device gradients: pack (converting bf16 to the bucket's f32),
// all-reduce, scale and write back, all on the device.
void device_bucket(Communicator& comm, Tensor& view, const ParameterList& params, const std::vector<size_t>& members,
                   double scale) {
  int64_t at = 0;
  for (size_t i : members) {
    const Tensor& w = params[i].tensor;
    Tensor slot = alias(view, w.shape(), at);
    Tensor g = w.grad();
    if (!g.defined()) fill_(slot, 0.0);
    else copy_(slot, g.dtype() == view.dtype() ? g : g.to(view.dtype()));
    at += w.numel();
  }
  comm.all_reduce_sum(view);
  at = 0;
  for (size_t i : members) {
    const Tensor& w = params[i].tensor;
    Tensor summed = mul_scalar(alias(view, w.shape(), at), scale);
    if (summed.dtype() != w.dtype()) summed = summed.to(w.dtype());
    Tensor g = w.grad();
    if (g.defined()) copy_(g, summed);
    else w.set_grad(summed);
    at += w.numel();
  }
}

}  // namespace

GradSyncStats all_reduce_grads(Communicator& comm, const ParameterList& params, const GradSyncOptions& options) {
  MT_CHECK(options.bucket_bytes > 0, "all_reduce_grads: bucket_bytes must be positive, got {}", options.bucket_bytes);
  NoGradGuard no_grad;
  std::unordered_set<const TensorImpl*> seen;  // a tensor listed twice would be summed twice
  for (const NamedParameter& p : params) {
    MT_CHECK(p.tensor.defined(), "all_reduce_grads: parameter '{}' is undefined", p.name);
    MT_CHECK(seen.insert(&p.tensor.impl()).second,
             "all_reduce_grads: parameter '{}' is listed twice (tied weights belong in the list once)", p.name);
    Tensor g = p.tensor.grad();
    MT_CHECK(p.tensor.device() == params.front().tensor.device(),
             "all_reduce_grads: parameter '{}' is on {} but '{}' on {}; one device per process",
             p.name, p.tensor.device(), params.front().name, params.front().tensor.device());
    MT_CHECK(!g.defined() || (g.device() == p.tensor.device() && g.dtype() == p.tensor.dtype() &&
                              g.shape() == p.tensor.shape()),
             "all_reduce_grads: the grad of '{}' is {} but the parameter is {}; expected a grad of the same "
             "shape, dtype and device",
             p.name, describe(g), describe(p.tensor));
    bucket_dtype(p);  // checks the dtype before any communication
  }

  // Which parameters have a grad on some rank.
  Tensor has_grad = zeros(Shape{static_cast<int64_t>(params.size())}, DType::i32);
  for (size_t i = 0; i < params.size(); ++i) has_grad.data<int32_t>()[i] = params[i].tensor.grad().defined() ? 1 : 0;
  comm.all_reduce_sum(has_grad);

  GradSyncStats stats;
  const Device device = params.empty() ? kCpu : params.front().tensor.device();
  for (DType dtype : {DType::f32, DType::f64}) {
    dispatch_float(dtype, "all_reduce_grads", [&](auto tag) {
      using T = decltype(tag);
      const int64_t capacity = std::max<int64_t>(1, options.bucket_bytes / static_cast<int64_t>(sizeof(T)));
      std::vector<size_t> members;  // indices into params of the current bucket
      int64_t filled = 0;           // elements
      Tensor buffer;
      auto flush = [&] {
        if (members.empty()) return;
        if (!buffer.defined() || buffer.numel() < filled) buffer = empty(Shape{filled}, dtype, device);
        Tensor view = alias(buffer, Shape{filled});
        if (device.is_cuda()) {  // the same steps with device copies; the sum goes through NCCL
          device_bucket(comm, view, params, members, options.scale);
          ++stats.num_buckets;
          stats.bytes += filled * static_cast<int64_t>(sizeof(T));
          members.clear();
          filled = 0;
          return;
        }
        T* data = view.data<T>();
        int64_t at = 0;
        for (size_t i : members) {
          pack(data + at, params[i]);
          at += params[i].tensor.numel();
        }
        comm.all_reduce_sum(view);
        at = 0;
        for (size_t i : members) {
          unpack(data + at, params[i], options.scale);
          at += params[i].tensor.numel();
        }
        ++stats.num_buckets;
        stats.bytes += filled * static_cast<int64_t>(sizeof(T));
        members.clear();
        filled = 0;
      };
      for (size_t i = 0; i < params.size(); ++i) {
        if (has_grad.data<int32_t>()[i] == 0 || bucket_dtype(params[i]) != dtype) continue;
        const int64_t n = params[i].tensor.numel();
        if (filled > 0 && filled + n > capacity) flush();
        members.push_back(i);
        filled += n;
      }
      flush();
    });
  }
  return stats;
}

}  // namespace moetrain::comm
