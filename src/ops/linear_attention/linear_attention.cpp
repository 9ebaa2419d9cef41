#include "ops/linear_attention/linear_attention.h"

#include <algorithm>

#include "autograd/node.h"
#include "ops/common/bf16_widen.h"
#include "ops/common/checks.h"
#include "ops/kda/kda_kernels.h"
#include "ops/linear_attention/linear_attention_kernels.h"

namespace moetrain {

namespace {

// q, k [B,T,H,K]; v [B,T,H,V]; h0 [B,H,K,V] or undefined.
void check_linear_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& h0,
                            const char* h0_name) {
  check_float(op, "q", q);
  check_float(op, "k", k);
  check_float(op, "v", v);
  check_same_kind(op, q, k);
  check_same_kind(op, q, v);
  if (h0.defined()) {
    check_float(op, h0_name, h0);
    check_same_kind(op, q, h0);
  }
  check_rank(op, "q", q, 4);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  MT_CHECK(H >= 1 && K >= 1, "{}: q is {}; expected [B, T, H, K] with H, K >= 1", op, q.shape());
  MT_CHECK(k.shape() == q.shape(), "{}: k is {}; expected [B, T, H, K] = {} like q", op, k.shape(), q.shape());
  check_rank(op, "v", v, 4);
  MT_CHECK(v.size(0) == B && v.size(1) == T && v.size(2) == H && v.size(3) >= 1,
           "{}: v is {}; expected [B, T, H, V] = [{}, {}, {}, V] (q {})", op, v.shape(), B, T, H, q.shape());
  if (h0.defined())
    MT_CHECK(h0.shape() == Shape({B, H, K, v.size(3)}),
             "{}: {} is {}; expected [B, H, K, V] = [{}, {}, {}, {}] (q {}, v {})", op, h0_name, h0.shape(), B, H, K,
             v.size(3), q.shape(), v.shape());
}

Tensor linear_attention_initial_state(const Tensor& q, const Tensor& v, const Tensor& h0) {
  if (h0.defined()) return h0.detach().clone();
  return zeros({q.size(0), q.size(2), q.size(3), v.size(3)}, q.dtype(), q.device());
}

// CUDA, either form: the recurrent kernel, saving the state every
// cpu::kKdaRecurrentSegment steps for the backward.
LinearAttentionResult linear_attention_cuda(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& h0) {
  Tensor o = empty(v.shape(), q.dtype(), q.device());
  Tensor state = linear_attention_initial_state(q, v, h0);
  Tensors inputs{q, k, v, h0};
  Tensor checkpoints;  // [B, H, segments, K, V]
  if (autograd::needs_grad(inputs))
    checkpoints = empty({q.size(0), q.size(2), cpu::kda_num_segments(q.size(1), cpu::kKdaRecurrentSegment), q.size(3),
                         v.size(3)}, stats_dtype(q), q.device());
  cuda::linear_attention_forward(o, state, checkpoints.defined() ? &checkpoints : nullptr, q, k, v);
  Tensors out = autograd::record(op, {o, state}, inputs, [=](const Tensors& grads) {
    Tensor grad_q = empty_like(q), grad_k = empty_like(k), grad_v = empty_like(v);
    Tensor grad_h0 = empty({q.size(0), q.size(2), q.size(3), v.size(3)}, q.dtype(), q.device());
    cuda::linear_attention_backward(grad_q, grad_k, grad_v, grad_h0, grads[0], grads[1], q, k, v, checkpoints);
    return Grads{grad_q, grad_k, grad_v, h0.defined() ? grad_h0 : Tensor()};
  });
  return {out[0], out[1]};
}

}  // namespace

LinearAttentionResult linear_attention_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& h0) {
  check_linear_attention("linear_attention_recurrent", q, k, v, h0, "h0");
  if (q.is_cuda()) return linear_attention_cuda("linear_attention_recurrent", q, k, v, h0);
  Tensor o = empty(v.shape(), q.dtype(), q.device());
  Tensor state = linear_attention_initial_state(q, v, h0);  // S_0, becomes S_T
  Tensor h0_saved = h0.defined() ? h0.detach() : Tensor();
  cpu::run_kernel("linear_attention_recurrent_forward", &cpu::linear_attention_recurrent_forward, o, state, q, k, v);
  Tensors out = autograd::record("linear_attention_recurrent", {o, state}, {q, k, v, h0}, [=](const Tensors& grads) {
    Tensor grad_q = empty_like(q), grad_k = empty_like(k), grad_v = empty_like(v);
    Tensor grad_h0 = empty({q.size(0), q.size(2), q.size(3), v.size(3)}, q.dtype(), q.device());
    cpu::run_kernel("linear_attention_recurrent_backward", &cpu::linear_attention_recurrent_backward, grad_q, grad_k,
                    grad_v, grad_h0, grads[0], grads[1], q, k, v, h0_saved);
    return Grads{grad_q, grad_k, grad_v, h0.defined() ? grad_h0 : Tensor()};
  });
  return {out[0], out[1]};
}

LinearAttentionResult linear_attention_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& h0,
                                               int64_t chunk_size) {
  check_linear_attention("linear_attention_chunked", q, k, v, h0, "h0");
  MT_CHECK(chunk_size >= 1, "linear_attention_chunked: chunk_size = {}; expected >= 1 (64 is the usual choice)",
           chunk_size);
  if (q.is_cuda()) return linear_attention_cuda("linear_attention_chunked", q, k, v, h0);
  chunk_size = std::min(chunk_size, std::max<int64_t>(q.size(1), 1));  // one chunk covers short sequences
  Tensor o = empty(v.shape(), q.dtype(), q.device());
  Tensor state = linear_attention_initial_state(q, v, h0);
  Tensors inputs{q, k, v, h0};
  Tensor chunk_states;  // [B, H, chunks, K, V]: S_n entering each chunk
  if (autograd::needs_grad(inputs))
    chunk_states = empty({q.size(0), q.size(2), cpu::linear_attention_num_chunks(q.size(1), chunk_size), q.size(3),
                          v.size(3)}, q.dtype(), q.device());
  cpu::run_kernel("linear_attention_chunked_forward", &cpu::linear_attention_chunked_forward, o, state,
                  chunk_states.defined() ? &chunk_states : nullptr, q, k, v, chunk_size);
  Tensors out = autograd::record("linear_attention_chunked", {o, state}, inputs, [=](const Tensors& grads) {
    Tensor grad_q = empty_like(q), grad_k = empty_like(k), grad_v = empty_like(v);
    Tensor grad_h0 = empty({q.size(0), q.size(2), q.size(3), v.size(3)}, q.dtype(), q.device());
    cpu::run_kernel("linear_attention_chunked_backward", &cpu::linear_attention_chunked_backward, grad_q, grad_k,
                    grad_v, grad_h0, grads[0], grads[1], q, k, v, chunk_states, chunk_size);
    return Grads{grad_q, grad_k, grad_v, h0.defined() ? grad_h0 : Tensor()};
  });
  return {out[0], out[1]};
}

LinearAttentionResult linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& h0,
                                       bool chunked, int64_t chunk_size) {
  if (chunked) return linear_attention_chunked(q, k, v, h0, chunk_size);
  return linear_attention_recurrent(q, k, v, h0);
}

Tensor linear_attention_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& state) {
  MT_CHECK(state.defined(),
           "linear_attention_decode_step: state is undefined; pass a [B, H, K, V] tensor (zeros to start)");
  check_linear_attention("linear_attention_decode_step", q, k, v, state, "state");
  MT_CHECK(q.size(1) == 1, "linear_attention_decode_step: q is {}; expected one token, [B, 1, H, K]", q.shape());
  MT_CHECK(!state.requires_grad(),
           "linear_attention_decode_step: state {} requires grad; the decode step updates it in place without "
           "autograd, pass a detached state", describe(state));
  Tensor o = empty(v.shape(), q.dtype(), q.device());
  Tensor s = state;
  if (q.is_cuda())
    cuda::linear_attention_forward(o, s, nullptr, q, k, v);
  else
    cpu::run_kernel("linear_attention_recurrent_forward", &cpu::linear_attention_recurrent_forward, o, s, q, k, v);
  return o;
}

}  // namespace moetrain
