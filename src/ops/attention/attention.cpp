#include "ops/attention/attention.h"

#include <limits>

#include "autograd/node.h"
#include "core/grad_mode.h"
#include "ops/attention/attention_kernels.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/reduce/reduce.h"

namespace moetrain {

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  return causal_attention(q, k, v, scale, nullptr);
}

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor* max_logit) {
  const char* op = "causal_attention";
  check_float(op, "q", q);
  check_same_kind(op, q, k);
  check_same_kind(op, q, v);
  check_rank(op, "q", q, 4);
  check_rank(op, "k", k, 4);
  check_rank(op, "v", v, 4);
  MT_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3) && k.size(1) >= q.size(1),
           "{}: q is {} and k is {}; they must be [B, T, H, Dk] and [B, Tk, H, Dk] with Tk >= T", op, q.shape(),
           k.shape());
  MT_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
           "{}: v is {} but k is {}; v must be [B, Tk, H, Dv] with the same B, Tk, H", op, v.shape(), k.shape());
  Tensor o = empty({q.size(0), q.size(1), q.size(2), v.size(3)}, v.dtype(), v.device());
  // lse [B, H, T]: q's dtype, f32 for bf16 q (backward's e^{S - lse} needs more than bf16's 3 digits)
  DType lse_dtype = stats_dtype(q);
  Tensor lse = empty({q.size(0), q.size(2), q.size(1)}, lse_dtype, q.device());
  // row_max [B, H, T] as lse: the row maxima the log-sum-exp subtracted; reduced
  // to [H] on the device (no host sync), over B then T.
  Tensor row_max;
  if (max_logit) row_max = empty({q.size(0), q.size(2), q.size(1)}, lse_dtype, q.device());
  MT_ON_DEVICE(q, causal_attention_forward, o, lse, q, k, v, scale, max_logit ? &row_max : nullptr);
  if (max_logit) {
    NoGradGuard no_grad;
    *max_logit = q.size(0) * q.size(1) == 0
                     ? full({q.size(2)}, -std::numeric_limits<double>::infinity(), lse_dtype, q.device())
                     : max(max(row_max, 2), 0);
  }
  Tensor o_saved = o.detach();
  return record(op, o, {q, k, v}, [q, k, v, o_saved, lse, scale](const Tensor& grad_o) {
    if (q.is_cuda()) {  // the CUDA kernels write every element of the grads
      Tensor grad_q = empty_like(q), grad_k = empty_like(k), grad_v = empty_like(v);
      cuda::causal_attention_backward(grad_q, grad_k, grad_v, grad_o, q, k, v, o_saved, lse, scale);
      return Grads{grad_q, grad_k, grad_v};
    }
    Tensor grad_q = empty_like(q), grad_k = zeros_like(k), grad_v = zeros_like(v);  // dK, dV accumulate
    cpu::run_kernel("causal_attention_backward", &cpu::causal_attention_backward, grad_q, grad_k, grad_v, grad_o, q, k,
                    v, o_saved, lse, scale);
    return Grads{grad_q, grad_k, grad_v};
  });
}

}  // namespace moetrain
