#include "ops/kda/kda.h"

#include <algorithm>

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/elementwise/elementwise.h"
#include "ops/view/view.h"
#include "ops/kda/kda_kernels.h"

namespace moetrain {

namespace {

// q, k [B,T,H,K]; v [B,T,HV,V] with HV % H == 0; g [B,T,HV,K]; beta [B,T,HV]; h0 [B,HV,K,V] or undefined.
void check_kda(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
               const Tensor& h0, const char* h0_name) {
  Tensors all{q, k, v, g, beta};
  const char* names[] = {"q", "k", "v", "g", "beta"};
  for (size_t i = 0; i < all.size(); ++i) check_float(op, names[i], all[i]);
  if (h0.defined()) check_float(op, h0_name, h0);
  for (size_t i = 1; i < all.size(); ++i) check_same_kind(op, q, all[i]);
  if (h0.defined()) check_same_kind(op, q, h0);
  check_rank(op, "q", q, 4);
  int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  MT_CHECK(H >= 1 && K >= 1, "{}: q is {}; expected [B, T, H, K] with H, K >= 1", op, q.shape());
  MT_CHECK(k.shape() == q.shape(), "{}: k is {}; expected [B, T, H, K] = {} like q", op, k.shape(), q.shape());
  check_rank(op, "v", v, 4);
  int64_t HV = v.size(2), V = v.size(3);
  MT_CHECK(v.size(0) == B && v.size(1) == T && HV >= H && HV % H == 0 && V >= 1,
           "{}: v is {}; expected [B, T, HV, V] = [{}, {}, HV, V] with HV a multiple of H = {} (q {})", op, v.shape(),
           B, T, H, q.shape());
  MT_CHECK(g.shape() == Shape({B, T, HV, K}), "{}: g is {}; expected [B, T, HV, K] = [{}, {}, {}, {}] (q {}, v {})", op,
           g.shape(), B, T, HV, K, q.shape(), v.shape());
  MT_CHECK(beta.shape() == Shape({B, T, HV}), "{}: beta is {}; expected [B, T, HV] = [{}, {}, {}] (v {})", op,
           beta.shape(), B, T, HV, v.shape());
  if (h0.defined())
    MT_CHECK(h0.shape() == Shape({B, HV, K, V}), "{}: {} is {}; expected [B, HV, K, V] = [{}, {}, {}, {}] (q {}, v {})",
             op, h0_name, h0.shape(), B, HV, K, V, q.shape(), v.shape());
}

Tensor initial_state(const Tensor& q, const Tensor& v, const Tensor& h0) {
  if (h0.defined()) return h0.detach().clone();
  return zeros({q.size(0), v.size(2), q.size(3), v.size(3)}, q.dtype(), q.device());
}

// The per-channel log decay of DeltaNet (zero) and Gated DeltaNet (g [B, T, HV]
// broadcast over K) for q [B, T, H, K]; v [B, T, HV, V] names HV.
Tensor zero_decay(const Tensor& q, const Tensor& v) {
  return zeros({q.size(0), q.size(1), v.size(2), q.size(3)}, q.dtype(), q.device());
}
Tensor head_decay(const char* op, const Tensor& g, const Tensor& q, const Tensor& v) {
  MT_CHECK(q.dim() == 4 && v.dim() == 4 && g.shape() == Shape({q.size(0), q.size(1), v.size(2)}),
           "{}: g is {}; expected one log decay per value head and step, [B, T, HV] (q {}, v {})", op, g.shape(),
           q.shape(), v.shape());
  return broadcast_to(reshape(g, {g.size(0), g.size(1), g.size(2), 1}), {g.size(0), g.size(1), g.size(2), q.size(3)});
}

}  // namespace

KdaMode parse_kda_mode(const std::string& name) {
  if (name == "recurrent") return KdaMode::recurrent;
  if (name == "chunked") return KdaMode::chunked;
  MT_THROW("kda: unknown mode '{}'; expected recurrent or chunked", name);
}

const char* kda_mode_name(KdaMode mode) { return mode == KdaMode::recurrent ? "recurrent" : "chunked"; }

// Forward per docs/model.md#kda-recurrent-form; backward: BPTT per docs/model.md#kda-recurrent-form from states recomputed segment by segment.
KdaResult kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const Tensor& h0, double scale) {
  check_kda("kda_recurrent", q, k, v, g, beta, h0, "h0");
  Tensor o = empty(v.shape(), q.dtype(), q.device());
  Tensor state = initial_state(q, v, h0);  // S_0, becomes S_T
  Tensors inputs{q, k, v, g, beta, h0};
  Tensor checkpoints;  // [B, HV, segments, K, V]
  if (autograd::needs_grad(inputs))
    checkpoints =
        empty({q.size(0), v.size(2), cpu::kda_num_segments(q.size(1), cpu::kKdaRecurrentSegment), q.size(3), v.size(3)},
              stats_dtype(q), q.device());
  Tensor* cp = checkpoints.defined() ? &checkpoints : nullptr;
  MT_ON_DEVICE(q, kda_recurrent_forward, o, state, cp, q, k, v, g, beta, scale);
  Tensors out = autograd::record("kda_recurrent", {o, state}, inputs, [=](const Tensors& grads) {
    Tensor grad_q = empty_like(q), grad_k = empty_like(k), grad_v = empty_like(v), grad_g = empty_like(g),
           grad_beta = empty_like(beta);
    Tensor grad_h0 = empty({q.size(0), v.size(2), q.size(3), v.size(3)}, q.dtype(), q.device());
    if (q.is_cuda())
      cuda::kda_recurrent_backward(grad_q, grad_k, grad_v, grad_g, grad_beta, grad_h0, grads[0], grads[1], q, k, v, g,
                                   beta, checkpoints, scale);
    else
      cpu::run_kernel("kda_recurrent_backward", &cpu::kda_recurrent_backward, grad_q, grad_k, grad_v, grad_g, grad_beta,
                      grad_h0, grads[0], grads[1], q, k, v, g, beta, checkpoints, scale);
    return Grads{grad_q, grad_k, grad_v, grad_g, grad_beta, h0.defined() ? grad_h0 : Tensor()};
  });
  return {out[0], out[1]};
}

// Forward per docs/model.md#kda-chunked-forward; backward per docs/model.md#kda-chunked-backward from the saved chunk-entry states.
KdaResult kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const Tensor& h0, double scale, int64_t chunk_size) {
  check_kda("kda_chunked", q, k, v, g, beta, h0, "h0");
  MT_CHECK(chunk_size >= 1, "kda_chunked: chunk_size = {}; expected >= 1 (64 is the usual choice)", chunk_size);
  chunk_size = std::min(chunk_size, std::max<int64_t>(q.size(1), 1));  // one chunk covers short sequences
  Tensor o = empty(v.shape(), q.dtype(), q.device());
  Tensor state = initial_state(q, v, h0);  // S_0, becomes S_T
  Tensors inputs{q, k, v, g, beta, h0};
  Tensor chunk_states;  // [B, HV, chunks, K, V]: S_n entering each chunk
  if (autograd::needs_grad(inputs))
    chunk_states = empty({q.size(0), v.size(2), cpu::kda_num_segments(q.size(1), chunk_size), q.size(3), v.size(3)},
                         stats_dtype(q), q.device());
  Tensor* cs = chunk_states.defined() ? &chunk_states : nullptr;
  MT_ON_DEVICE(q, kda_chunked_forward, o, state, cs, q, k, v, g, beta, scale, chunk_size);
  Tensors out = autograd::record("kda_chunked", {o, state}, inputs, [=](const Tensors& grads) {
    Tensor grad_q = empty_like(q), grad_k = empty_like(k), grad_v = empty_like(v), grad_g = empty_like(g),
           grad_beta = empty_like(beta);
    Tensor grad_h0 = empty({q.size(0), v.size(2), q.size(3), v.size(3)}, q.dtype(), q.device());
    if (q.is_cuda())
      cuda::kda_chunked_backward(grad_q, grad_k, grad_v, grad_g, grad_beta, grad_h0, grads[0], grads[1], q, k, v, g,
                                 beta, chunk_states, scale, chunk_size);
    else
      cpu::run_kernel("kda_chunked_backward", &cpu::kda_chunked_backward, grad_q, grad_k, grad_v, grad_g, grad_beta,
                      grad_h0, grads[0], grads[1], q, k, v, g, beta, chunk_states, scale, chunk_size);
    return Grads{grad_q, grad_k, grad_v, grad_g, grad_beta, h0.defined() ? grad_h0 : Tensor()};
  });
  return {out[0], out[1]};
}

KdaResult kda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& h0,
              double scale, KdaMode mode, int64_t chunk_size) {
  if (mode == KdaMode::recurrent) return kda_recurrent(q, k, v, g, beta, h0, scale);
  return kda_chunked(q, k, v, g, beta, h0, scale, chunk_size);
}

KdaResult delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& h0,
                     double scale, KdaMode mode, int64_t chunk_size) {
  check_rank("delta_rule", "q", q, 4);
  check_rank("delta_rule", "v", v, 4);
  return kda(q, k, v, zero_decay(q, v), beta, h0, scale, mode, chunk_size);
}

KdaResult gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                           const Tensor& h0, double scale, KdaMode mode, int64_t chunk_size) {
  return kda(q, k, v, head_decay("gated_delta_rule", g, q, v), beta, h0, scale, mode, chunk_size);
}

Tensor delta_rule_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                              const Tensor& state, double scale) {
  check_rank("delta_rule_decode_step", "q", q, 4);
  check_rank("delta_rule_decode_step", "v", v, 4);
  return kda_decode_step(q, k, v, zero_decay(q, v), beta, state, scale);
}

Tensor gated_delta_rule_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& beta, const Tensor& state, double scale) {
  return kda_decode_step(q, k, v, head_decay("gated_delta_rule_decode_step", g, q, v), beta, state, scale);
}

Tensor kda_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& state, double scale) {
  MT_CHECK(state.defined(), "kda_decode_step: state is undefined; pass a [B, HV, K, V] tensor (zeros to start)");
  check_kda("kda_decode_step", q, k, v, g, beta, state, "state");
  MT_CHECK(q.size(1) == 1, "kda_decode_step: q is {}; expected one token, [B, 1, H, K]", q.shape());
  MT_CHECK(!state.requires_grad(),
           "kda_decode_step: state {} requires grad; the decode step updates it in place "
           "without autograd, pass a detached state",
           describe(state));
  Tensor o = empty(v.shape(), q.dtype(), q.device());
  Tensor s = state;
  MT_ON_DEVICE(q, kda_recurrent_forward, o, s, nullptr, q, k, v, g, beta, scale);
  return o;
}

}  // namespace moetrain
