// Embedding = index_select over the rows of the table: it shares the gather
// and the race-free scatter-add kernels of view_cpu.cpp / view_cuda.cu.
//
// Two paths. Host ids (the trainer's batch; CPU tables always): checked on the
// host, an out-of-range id an error naming it, and the backward's plan made
// there. Ids and table both on a CUDA device: nothing goes to the host (no copy,
// no wait, so a step can be captured in a CUDA graph, issue 41); the range is
// the business of whoever made the ids (the data loader checks every id at
// open), and an id outside [0, V) gives a NaN row (the loss is then NaN and the
// trainer skips the step), as cross_entropy does with device targets. The
// backward then plans on the device (view_simt.h): the same gradient bits.
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
  Tensor index = ids.dtype() == DType::u16 ? ids.to(DType::i32) : ids;  // on the ids' device
  int64_t vocab = weight.size(0), dim = weight.size(1);
  Tensor y = empty(ids.shape().appended(dim), weight.dtype(), weight.device());
  if (weight.is_cuda() && index.is_cuda()) {
    Tensor flat = alias(index.to(weight.device()), {index.numel()});
    cuda::index_select_forward_or_nan(y, weight, flat, 1, dim);
    return record("embedding", y, {weight}, [weight, flat, dim](const Tensor& g) {
      Tensor grad_w = zeros_like(weight);
      cuda::index_select_backward(grad_w, g, flat, 1, dim);  // plans on the device
      return Grads{grad_w};
    });
  }
  // Ids are checked on the host (for CUDA ids with a CPU table: a copy and a
  // wait), then read by the kernel where the table lives.
  Tensor host = index.to(kCpu);
  dispatch_index(index.dtype(), "embedding", [&](auto tag) {
    using I = decltype(tag);
    const I* p = host.data<I>();
    for (int64_t i = 0; i < index.numel(); ++i)
      MT_CHECK(p[i] >= 0 && p[i] < vocab, "embedding: token id {} at position {} of ids {} is out of range [0, {}) "
               "for the table {}", static_cast<int64_t>(p[i]), i, ids.shape(), vocab, weight.shape());
  });
  Tensor flat = alias(index.to(weight.device()), {index.numel()});
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
