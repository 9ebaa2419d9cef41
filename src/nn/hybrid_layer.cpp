// The hybrid decoder layer and its two residual streams (nn/hybrid_layer.h). The
// AttnRes bookkeeping follows docs/model.md#attnres-schedule line by line.
#include "nn/hybrid_layer.h"

#include "core/profile.h"
#include "ops/attnres/attnres.h"
#include "ops/elementwise/elementwise.h"
#include "ops/norm/norm.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

// Profile regions (core/profile.h): each mixer with its pre-norm, each FFN with its
// pre-norm, AttnRes. The sublayers on their normed input (given as `normed`, or
// made here from `input`).
Tensor run_mixer(const HybridLayer& L, const Tensor& input, const LayerCall& call, Tensor normed = Tensor()) {
  profile::Region region(mixer_kind_name(L.mixer->kind()));
  if (!normed.defined()) normed = rms_norm(input, L.input_layernorm, call.eps);
  return L.mixer->forward(normed, call.cache);
}

Tensor run_ffn(const HybridLayer& L, const Tensor& input, const LayerCall& call, Tensor normed = Tensor()) {
  profile::Region region(L.ffn->component());
  if (!normed.defined()) normed = rms_norm(input, L.post_attention_layernorm, call.eps);
  return L.ffn->forward(normed, call.training);
}

// This call's auxiliary loss (MoeLayer::forward sets it per call).
Tensor aux_of(const HybridLayer& L) { return L.moe ? L.moe->aux_loss() : Tensor(); }

}  // namespace

LayerOutput PlainResidual::layer(const HybridLayer& L, const Tensors& state, const LayerCall& call) const {
  // Each residual add and the RMSNorm of its sum are one op (add_rms_norm): the
  // mixer's add with the FFN's pre-norm and, when the caller gives the next layer's
  // input norm, the FFN's add with it (the state then carries that normed sum).
  const Tensor& hidden = state[0];
  Tensor a = run_mixer(L, hidden, call, state.size() > 1 ? state[1] : Tensor());
  ResidualNorm h;
  {
    profile::Region region(L.ffn->component());
    h = add_rms_norm(hidden, a, L.post_attention_layernorm, call.eps);
  }
  Tensor f = run_ffn(L, h.sum, call, h.normed);
  LayerOutput out;
  out.aux_loss = aux_of(L);
  if (call.next_input_norm.defined()) {
    profile::Region region(L.ffn->component());
    ResidualNorm next = add_rms_norm(h.sum, f, call.next_input_norm, call.eps);
    out.made = {next.sum, next.normed};
  } else {
    out.made = {add(h.sum, f)};
  }
  return out;
}

LayerOutput BlockAttnRes::layer(const HybridLayer& L, const Tensors& state, const LayerCall& call) const {
  // The layer reads each state tensor through one identity, so the gradients of a
  // tensor's uses inside the layer are summed there first and reach the tensor as one
  // sum per layer: the same order of additions as when checkpoint() runs the layer
  // (recomputation's gradients equal these bit for bit).
  Tensors in;
  in.reserve(state.size());
  for (const Tensor& t : state) in.push_back(reshape(t, t.shape()));
  Tensors blocks(in.begin(), in.end() - 1);  // the embedding and the completed block sums
  Tensor hidden = in.back();                  // the open block's running sum
  auto read = [&](const Tensor& last, const Tensor& proj, const Tensor& norm) {
    profile::Region region("attnres");
    Tensors sources = blocks;
    sources.push_back(last);
    return attn_res(sources, proj, norm, call.eps);
  };
  Tensor prefix = hidden, x = hidden;
  if (!blocks.empty()) x = read(prefix, L.attn_res_proj, L.attn_res_norm);
  if (L.index % block_size_ == 0) {  // a block opens: the sum so far is complete
    blocks.push_back(prefix);
    prefix = Tensor();
  }
  Tensor a = run_mixer(L, x, call);
  prefix = prefix.defined() ? add(prefix, a) : a;
  x = read(prefix, L.mlp_res_proj, L.mlp_res_norm);
  LayerOutput out;
  out.made = {add(prefix, run_ffn(L, x, call))};
  out.aux_loss = aux_of(L);
  return out;
}

Tensors BlockAttnRes::next_state(const HybridLayer& L, Tensors state, Tensors made) const {
  // At a block's first layer the state's open sum became a completed block sum.
  if (L.index % block_size_ != 0) state.pop_back();
  state.push_back(made[0]);
  return state;
}

}  // namespace moetrain
