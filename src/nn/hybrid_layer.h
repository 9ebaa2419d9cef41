// One decoder layer of the hybrid model as a unit (docs/model.md#full-decoder): the
// mixer and the FFN with their pre-norms and AttnRes reads, run on a residual state
// and returning the next one. How the state looks and how the sublayers read and
// write it is the residual stream's business, two small strategies:
//   PlainResidual  the standard pre-norm stream (Kimi-Linear): state {hidden}, or
//                  {hidden, normed} where the previous layer's last add was fused
//                  with this layer's input norm (add_rms_norm);
//   BlockAttnRes   Block Attention Residuals (docs/model.md#attnres-schedule): state
//                  {embedding, completed block sums..., running sum of the open block}.
// A layer call makes its new tensors and the MoE auxiliary loss of that call; the
// stream folds them into the next state. Activation recomputation
// (docs/training.md#activation-recomputation) wraps exactly one such call in
// checkpoint(): the call's inputs are the state, its outputs what it made.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"
#include "nn/ffn.h"
#include "nn/language_model.h"
#include "nn/mixer.h"
#include "nn/moe.h"

namespace moetrain {

struct HybridLayer {
  int64_t index = 0;  // l, in the whole model
  std::unique_ptr<Mixer> mixer;
  std::unique_ptr<FeedForward> ffn;
  MoeLayer* moe = nullptr;  // ffn, when it is an MoE layer
  Tensor input_layernorm, post_attention_layernorm;
  Tensor attn_res_proj, attn_res_norm, mlp_res_proj, mlp_res_norm;  // AttnRes (attn pair absent at layer 0)
  std::unique_ptr<QkClipSite> site;  // MLA and attention mixers of this stage's layers; none for the others
};

// What a layer call sees besides the state.
struct LayerCall {
  double eps = 1e-5;
  bool training = true;
  MixerCache* cache = nullptr;  // decoding
  // PlainResidual: the next layer's input norm weight, to fuse this layer's last add
  // with it (the new state is then {hidden, normed}); undefined: a plain add, state {hidden}.
  Tensor next_input_norm;
};

// What one layer call made.
struct LayerOutput {
  Tensors made;      // the stream's new tensors (PlainResidual: the new state; BlockAttnRes: the open sum)
  Tensor aux_loss;   // the MoE layer's auxiliary loss of this call; undefined when it has none
};

class ResidualStream {
 public:
  virtual ~ResidualStream() = default;
  // Layer `layer` on `state`.
  virtual LayerOutput layer(const HybridLayer& layer, const Tensors& state, const LayerCall& call) const = 0;
  // The state before the next layer, from the state before `layer` and what it made.
  virtual Tensors next_state(const HybridLayer& layer, Tensors state, Tensors made) const = 0;
};

class PlainResidual : public ResidualStream {
 public:
  LayerOutput layer(const HybridLayer& layer, const Tensors& state, const LayerCall& call) const override;
  Tensors next_state(const HybridLayer&, Tensors, Tensors made) const override { return made; }
};

class BlockAttnRes : public ResidualStream {
 public:
  explicit BlockAttnRes(int64_t block_size) : block_size_(block_size) {}
  LayerOutput layer(const HybridLayer& layer, const Tensors& state, const LayerCall& call) const override;
  Tensors next_state(const HybridLayer& layer, Tensors state, Tensors made) const override;

 private:
  int64_t block_size_;  // S, in decoder layers: a block opens at l % S == 0
};

}  // namespace moetrain
