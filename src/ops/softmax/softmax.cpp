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

int64_t check_cross_entropy_targets(const Tensor& targets, int64_t num_classes, int64_t ignore_index,
                                    int64_t padding) {
  MT_CHECK(!targets.is_cuda(), "check_cross_entropy_targets: targets {} must be on the host", describe(targets));
  int64_t counted = 0;
  dispatch_index(targets.dtype(), "cross_entropy", [&](auto tag) {
    using I = decltype(tag);
    const Tensor c = targets.contiguous();
    const I* t = c.data<I>();
    for (int64_t i = 0; i < c.numel(); ++i) {
      MT_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < num_classes),
               "cross_entropy: target {} at position {} is out of range [0, {}) (ignore_index is {}{})",
               static_cast<int64_t>(t[i]), i, num_classes, ignore_index,
               padding > 0 ? fmt::format("; the {} columns past them are a padded vocabulary's padding", padding)
                           : std::string());
      counted += t[i] != ignore_index;
    }
  });
  return counted;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, Reduction reduction,
                     int64_t num_classes) {
  check_float("cross_entropy", "logits", logits);
  check_rank("cross_entropy", "logits", logits, -1);
  MT_CHECK(is_integral(targets.dtype()) && (targets.dtype() == DType::i32 || targets.dtype() == DType::i64),
           "cross_entropy: targets must be i32 or i64, got {}", describe(targets));
  MT_CHECK(targets.shape() == logits.shape().drop_last(),
           "cross_entropy: logits {} need targets of shape {}, got {}", logits.shape(), logits.shape().drop_last(),
           targets.shape());
  MT_CHECK(targets.device() == logits.device(), "cross_entropy: logits are on {} but targets on {}",
           logits.device(), targets.device());
  const int64_t vocab = logits.size(-1);
  if (num_classes < 0) num_classes = vocab;
  MT_CHECK(num_classes >= 1 && num_classes <= vocab,
           "cross_entropy: num_classes = {} must be in [1, {}] for logits {} (the columns past it are padding)",
           num_classes, vocab, logits.shape());
  const bool mean = reduction == Reduction::mean;
  Tensor lse = empty(logits.shape().drop_last(), DType::f64, logits.device());  // f64: exact e^{x - lse} in backward
  // The loss in the arithmetic's dtype: f32 for bf16 logits (softmax.h).
  const DType loss_dtype = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  if (logits.is_cuda()) {
    // Device targets are not read on the host (that would wait for the GPU every
    // step): the counted rows stay on the device, and the range is the business of
    // whoever made the targets (the data loader checks every id at open; a target
    // out of range gives NaN, docs/cuda.md#cross-entropy-on-bf16-logits).
    Tensor loss = empty({}, loss_dtype, logits.device());
    Tensor counted = empty({}, DType::f64, logits.device());
    cuda::cross_entropy_forward(lse, loss, counted, logits, targets, ignore_index, num_classes, mean);
    return record("cross_entropy", loss, {logits},
                  [logits, targets, lse, counted, mean, ignore_index, num_classes, loss_dtype](const Tensor& g) {
                    Tensor grad_logits = empty_like(logits);  // the incoming gradient stays on the device
                    cuda::cross_entropy_backward(grad_logits, logits, targets, lse, g.to(loss_dtype), counted, mean,
                                                 ignore_index, num_classes);
                    return Grads{grad_logits};
                  });
  }
  const int64_t counted = check_cross_entropy_targets(targets, num_classes, ignore_index, vocab - num_classes);
  const double divisor = mean ? static_cast<double>(std::max<int64_t>(counted, 1)) : 1.0;
  double loss_sum = 0;
  int64_t count = 0;
  cpu::run_kernel("cross_entropy_forward", &cpu::cross_entropy_forward, lse, loss_sum, count, logits, targets,
                  ignore_index, num_classes);
  Tensor loss = full({}, loss_sum / divisor, loss_dtype, logits.device());
  return record("cross_entropy", loss, {logits}, [logits, targets, lse, divisor, ignore_index, num_classes](const Tensor& g) {
    Tensor grad_logits = empty_like(logits);
    cpu::run_kernel("cross_entropy_backward", &cpu::cross_entropy_backward, grad_logits, logits, targets, lse,
                    g.item<double>() / divisor, ignore_index, num_classes);
    return Grads{grad_logits};
  });
}

}  // namespace moetrain
