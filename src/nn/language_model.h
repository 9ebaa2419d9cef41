// What the trainer, sampler and evaluator need from a model, whatever its
// architecture (GPT-2, the K3-style hybrid, ...).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"
#include "nn/pipeline_stages.h"

namespace moetrain {

class HfAdapter;  // nn/hf_adapter.h
class MoeLayer;
namespace comm {
class Communicator;
}

// Per-sequence decoding state (KV caches, recurrent states). length() tokens seen.
// What one pipeline stage's forward gives (LanguageModel::stage_forward).
struct StageOutput {
  Tensors activations;  // not the last stage: what the next stage receives, [B, T, D] each
  Tensor loss;          // the last stage with targets: cross-entropy + its MoE layers' aux losses;
                        // other stages: their MoE layers' aux losses (undefined when there are none)
  Tensor logits;        // the last stage without targets: [B, T, vocab]
};

// An MLA layer's head dimensions, as QK-Clip's row layout needs them (optim/qk_clip.h).
struct MlaHeadDims {
  int64_t n_head = 0;            // H
  int64_t qk_nope_head_dim = 0;  // dn
  int64_t qk_rope_head_dim = 0;  // dr
  int64_t v_head_dim = 0;        // dv
};

// One softmax-attention layer whose logits QK-Clip bounds (docs/model.md#qk-clip).
struct QkClipSite {
  enum class Layout { mla, separate_qk, fused_qkv };
  Layout layout = Layout::mla;
  // Parameter names as in parameters() (full names, e.g. model.layers.1.self_attn.kv_b_proj.weight):
  // mla: q_b_proj.weight (or q_proj.weight without query LoRA) and kv_b_proj.weight;
  // separate_qk: q_proj.weight, k_proj.weight; fused_qkv: attn.c_attn.weight, k_weight empty.
  std::string q_weight, k_weight;
  std::string q_bias, k_bias;  // separate_qk: biases or empty; fused_qkv: attn.c_attn.bias in q_bias (empty if none)
  int64_t n_head = 0;
  MlaHeadDims mla;    // layout mla only
  std::string layer;  // a short label for logs/metrics, e.g. "layers.3" (the layer index in the whole
                      // model, also under pp)
  Tensor max_logit;   // [n_head], on the parameters' device, f32 (f64 in f64 runs): the running max since
                      // the last reset; undefined until a recorded forward
};

// The layers' side of the statistic: folds one attention call's max_logit [H]
// (causal_attention's, ops/attention/attention.h) into site.max_logit, on the
// device (an elementwise max: no host sync).
void fold_max_logit(QkClipSite& site, const Tensor& max_logit);
// Whether a layer given `site` (null: not tracking) records now: grad mode on.
bool wants_max_logit(const QkClipSite* site);

struct DecodeCache {
  virtual ~DecodeCache() = default;
  virtual int64_t length() const = 0;
  virtual int64_t bytes() const = 0;  // memory held by the caches
};

class LanguageModel {
 public:
  virtual ~LanguageModel() = default;

  virtual std::string arch() const = 0;      // "gpt2", "hybrid"
  virtual std::string describe() const = 0;  // one line: layers, widths, dtype
  virtual int64_t vocab_size() const = 0;
  // Columns of the LM head: vocab_size() rounded up (model.vocab_pad_multiple,
  // docs/model.md#padded-vocabulary). The columns past vocab_size() are padding:
  // outside the loss's softmax, never sampled, not exported.
  virtual int64_t padded_vocab_size() const { return vocab_size(); }
  virtual int64_t max_positions() const = 0;  // longest sequence the model accepts
  virtual DType dtype() const = 0;

  // ids [B, T] -> logits [B, T, vocab_size].
  virtual Tensor forward(const Tensor& ids, bool training = true) = 0;
  // ids [B, T] -> logits [B, T, padded_vocab_size()]: the head's output before
  // forward() cuts the padding columns off (no copy); what loss() reads.
  virtual Tensor forward_padded(const Tensor& ids, bool training = true) { return forward(ids, training); }
  // Mean next-token cross-entropy of forward(ids) against targets [B, T], over
  // the vocab_size() real classes (the padding columns take no part).
  virtual Tensor loss(const Tensor& ids, const Tensor& targets, bool training = true);

  // Decoding: appends ids [B, T] after the cached tokens and returns their logits;
  // records nothing.
  virtual std::unique_ptr<DecodeCache> new_cache() const = 0;
  virtual Tensor forward_cached(const Tensor& ids, DecodeCache& cache) = 0;

  virtual ParameterList& parameters() = 0;
  const ParameterList& parameters() const { return const_cast<LanguageModel*>(this)->parameters(); }
  // Persistent state that is not trained (e.g. MoE router biases): saved and loaded
  // with the weights, never touched by the optimizer.
  virtual ParameterList buffers() const { return {}; }
  // The MoE layers in layer order (their statistics, bias updates and expert
  // shards are the trainer's business); none for dense models.
  virtual std::vector<MoeLayer*> moe_layers() const { return {}; }
  // The expert-parallel group of every MoE layer (MoeLayer::set_expert_group);
  // nothing to do for a model without MoE layers.
  virtual void set_expert_group(comm::Communicator*) {}
  // Training FLOPs per token (forward + backward) at sequence length seq_len.
  virtual double flops_per_token(int64_t seq_len) const = 0;
  // Saved activations per token of a training micro-batch (an estimate, bytes).
  // mixed_precision (train.dtype bf16): the model's wide activations and the logits
  // are bf16, what docs/model.md#mixed-precision keeps in f32 (KDA internals, router scores) stays 4 bytes.
  virtual double activation_bytes_per_token(bool mixed_precision) const = 0;
  // Bytes of the decoding cache of one sequence after `length` tokens (what
  // new_cache() holds then, from the shapes alone): linear in the length for
  // attention, constant for recurrent mixers.
  virtual int64_t decode_cache_bytes(int64_t length) const = 0;

  // Pipeline parallelism (train.pp, docs/parallelism.md#pipeline-parallelism). A
  // model built for one stage holds only that stage's parameters (their values
  // those of the whole model with the same seed); forward(), loss() and decoding
  // need the whole model.
  // With virtual stages (train.pp_virtual) a rank's model holds pipeline_stage().chunks
  // stages, its chunks; `chunk` below picks one (0 without virtual stages).
  virtual PipelineStage pipeline_stage() const { return {}; }
  // The chunk's layers [first, end) (all of them for the whole model; empty for a model without layers).
  virtual StageLayers pipeline_stage_layers(int64_t chunk = 0) const { return {}; }
  // How many [B, T, hidden_size()] tensors the chunk receives from the previous
  // virtual stage (0 for the first).
  virtual int64_t stage_input_count(int64_t chunk = 0) const { return 0; }
  virtual int64_t hidden_size() const { return 0; }
  // One chunk's forward on one micro-batch: virtual stage 0 reads ids [B, T], the
  // others `inputs` (what the previous one's activations were); the last gives the
  // loss against targets, or the logits when targets is undefined. For the whole
  // model: the loss (or logits) of ids.
  virtual StageOutput stage_forward(const Tensor& ids, const Tensors& inputs, const Tensor& targets, bool training,
                                    int64_t chunk = 0);
  // Whether a parameter or buffer of the whole model with this name belongs to
  // this stage (checkpoint loads: a name of another stage is not "unexpected").
  virtual bool stage_holds(const std::string& name) const { return true; }

  // QK-Clip's statistic: while on, every forward with grad mode enabled (training; not eval, not
  // generation) folds each softmax-attention head's largest logit into its site's max_logit.
  virtual void set_track_max_logits(bool on);
  // This process's sites (its pipeline stage's layers), in layer order; the pointers stay valid for
  // the model's lifetime.
  virtual std::vector<QkClipSite*> qk_clip_sites();
  void reset_max_logits();  // every site's max_logit undefined again

  // The family's Hugging Face adapter (nn/hf_adapter.h: names, config.json, import and
  // export), bound to this model's configuration; nullptr: the model has no HF layout.
  virtual std::unique_ptr<HfAdapter> hf_adapter() const;
};

}  // namespace moetrain
