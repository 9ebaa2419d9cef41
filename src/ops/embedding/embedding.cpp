// Embedding = index_select over the rows of the table: it shares the gather
// and the race-free scatter-add kernels of view_cpu.cpp.
#include "ops/embedding/embedding.h"

#include "autograd/node.h"
#include "core/dispatch.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/view/view_kernels.h"

namespace moetrain {

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  check_float("embedding", "weight", weight);
  check_rank("embedding", "weight", weight, 2);
  MT_CHECK(ids.dtype() == DType::i32 || ids.dtype() == DType::i64 || ids.dtype() == DType::u16,
           "embedding: ids must be i32, i64 or u16, got {}", describe(ids));
  Tensor index = ids.dtype() == DType::u16 ? ids.to(DType::i32) : ids;
  int64_t vocab = weight.size(0), dim = weight.size(1);
  // Ids are checked on the host (for CUDA ids: a copy and a wait), then read
  // by the kernel where the table lives.
  Tensor host = index.to(kCpu);
  dispatch_index(index.dtype(), "embedding", [&](auto tag) {
    using I = decltype(tag);
    const I* p = host.data<I>();
    for (int64_t i = 0; i < index.numel(); ++i)
      MT_CHECK(p[i] >= 0 && p[i] < vocab, "embedding: token id {} at position {} of ids {} is out of range [0, {}) "
               "for the table {}", static_cast<int64_t>(p[i]), i, ids.shape(), vocab, weight.shape());
  });
  Tensor flat = alias(index.to(weight.device()), {index.numel()});
  Tensor y = empty(ids.shape().appended(dim), weight.dtype(), weight.device());
  MT_ON_DEVICE(weight, index_select_forward, y, weight, flat, 1, dim);
  // Backward takes the host ids on both devices (view_kernels.h).
  Tensor host_flat = alias(host, {index.numel()});
  return record("embedding", y, {weight}, [weight, host_flat, dim](const Tensor& g) {
    Tensor grad_w = zeros_like(weight);
    MT_ON_DEVICE(g, index_select_backward, grad_w, g, host_flat, 1, dim);
    return Grads{grad_w};
  });
}

}  // namespace moetrain
