#include "ops/softmax/softmax.h"

#include "autograd/node.h"
#include "core/dispatch.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/softmax/softmax_kernels.h"

namespace moetrain {

namespace {
Tensor softmax_impl(const Tensor& x, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  check_float(op, "x", x);
  check_rank(op, "x", x, -1);
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, softmax_forward, y, x, log);
  Tensor y_saved = y.detach();
  return record(op, y, {x}, [y_saved, log](const Tensor& grad_y) {
    Tensor grad_x = empty_like(y_saved);
    MT_ON_DEVICE(y_saved, softmax_backward, grad_x, grad_y, y_saved, log);
    return Grads{grad_x};
  });
}
}  // namespace

Tensor softmax(const Tensor& x) { return softmax_impl(x, false); }
Tensor log_softmax(const Tensor& x) { return softmax_impl(x, true); }

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, Reduction reduction) {
  check_float("cross_entropy", "logits", logits);
  check_rank("cross_entropy", "logits", logits, -1);
  MT_CHECK(is_integral(targets.dtype()) && (targets.dtype() == DType::i32 || targets.dtype() == DType::i64),
           "cross_entropy: targets must be i32 or i64, got {}", describe(targets));
  MT_CHECK(targets.shape() == logits.shape().drop_last(),
           "cross_entropy: logits {} need targets of shape {}, got {}", logits.shape(), logits.shape().drop_last(),
           targets.shape());
  MT_CHECK(targets.device() == logits.device(), "cross_entropy: logits are on {} but targets on {}",
           logits.device(), targets.device());
  int64_t vocab = logits.size(-1);
  // The range check reads the targets on the host: for CUDA logits this copies
  // them to the host (and waits for the stream), which also gives the count of
  // counted rows that the mean divides by.
  Tensor host_targets = targets.is_cuda() ? targets.to(kCpu) : targets;
  int64_t counted = 0;
  dispatch_index(targets.dtype(), "cross_entropy", [&](auto tag) {
    using I = decltype(tag);
    const I* t = host_targets.data<I>();
    for (int64_t i = 0; i < targets.numel(); ++i) {
      MT_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < vocab),
               "cross_entropy: target {} at position {} is out of range [0, {}) (ignore_index is {})",
               static_cast<int64_t>(t[i]), i, vocab, ignore_index);
      counted += t[i] != ignore_index;
    }
  });
  Tensor lse = empty(logits.shape().drop_last(), DType::f64, logits.device());  // f64: exact e^{x - lse} in backward
  double divisor = reduction == Reduction::mean ? static_cast<double>(std::max<int64_t>(counted, 1)) : 1.0;
  Tensor loss;
  if (logits.is_cuda()) {
    loss = empty({}, logits.dtype(), logits.device());
    cuda::cross_entropy_forward(lse, loss, logits, targets, ignore_index, divisor);
  } else {
    double loss_sum = 0;
    int64_t count = 0;
    cpu::cross_entropy_forward(lse, loss_sum, count, logits, targets, ignore_index);
    loss = full({}, loss_sum / divisor, logits.dtype(), logits.device());
  }
  return record("cross_entropy", loss, {logits}, [logits, targets, lse, divisor, ignore_index](const Tensor& g) {
    Tensor grad_logits = empty_like(logits);
    if (logits.is_cuda())  // the incoming gradient stays on the device
      cuda::cross_entropy_backward(grad_logits, logits, targets, lse, g.to(logits.dtype()), 1.0 / divisor,
                                   ignore_index);
    else
      cpu::cross_entropy_backward(grad_logits, logits, targets, lse, g.item<double>() / divisor, ignore_index);
    return Grads{grad_logits};
  });
}

}  // namespace moetrain
