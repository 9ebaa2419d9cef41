// Hybrid decoder forward (docs/model.md#attnres-schedule, docs/model.md#full-decoder). Built from gradient-checked
// ops and layers; the AttnRes bookkeeping follows docs/model.md#attnres-schedule line by line.
#include "nn/hybrid.h"

#include <cmath>
#include <cstdlib>
#include <map>

#include <fmt/format.h>

#include "autograd/engine.h"
#include "config/config.h"
#include "core/grad_mode.h"
#include "core/profile.h"
#include "nn/attention_mixer.h"
#include "ops/attnres/attnres.h"
#include "ops/elementwise/elementwise.h"
#include "ops/embedding/embedding.h"
#include "ops/linalg/linalg.h"
#include "ops/norm/norm.h"
#include "ops/softmax/softmax.h"
#include "ops/view/view.h"

namespace moetrain {

std::vector<MixerKind> mixer_schedule(int64_t n_layer, const std::string& explicit_list, MixerKind mixer,
                                      MixerKind attn_mixer, int64_t every, int64_t offset, bool last) {
  std::vector<MixerKind> out;
  if (!explicit_list.empty()) {
    for (const std::string& item : split_comma_list(explicit_list)) out.push_back(parse_mixer_kind(item));
    MT_CHECK(static_cast<int64_t>(out.size()) == n_layer, "the mixer list names {} layers but n_layer is {}",
             out.size(), n_layer);
    return out;
  }
  for (int64_t l = 0; l < n_layer; ++l) {
    bool attn = (every > 0 && l % every == offset) || (last && l == n_layer - 1);
    out.push_back(attn ? attn_mixer : mixer);
  }
  return out;
}

namespace {

// One mixer cache per layer, made by the layer's mixer at the first call.
struct HybridCache : DecodeCache {
  std::vector<std::unique_ptr<MixerCache>> mixers;
  int64_t tokens = 0;
  int64_t length() const override { return tokens; }
  int64_t bytes() const override {
    int64_t n = 0;
    for (const auto& c : mixers) n += c->bytes();
    return n;
  }
};

}  // namespace

namespace {

// The QK-Clip site of a softmax-attention mixer at `prefix` (layer l); null for the others.
std::unique_ptr<QkClipSite> qk_clip_site_of(const Mixer& mixer, const std::string& prefix, int64_t l) {
  auto site = std::make_unique<QkClipSite>();
  site->layer = fmt::format("layers.{}", l);
  if (mixer.kind() == MixerKind::mla) {
    const MlaConfig& m = static_cast<const MlaLayer&>(mixer).config();
    site->layout = QkClipSite::Layout::mla;
    site->q_weight = prefix + (m.q_lora_rank > 0 ? "q_b_proj.weight" : "q_proj.weight");
    site->k_weight = prefix + "kv_b_proj.weight";
    site->n_head = m.n_head;
    site->mla = MlaHeadDims{m.n_head, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim};
    return site;
  }
  if (mixer.kind() == MixerKind::attention) {
    site->layout = QkClipSite::Layout::separate_qk;
    site->q_weight = prefix + "q_proj.weight";
    site->k_weight = prefix + "k_proj.weight";
    site->n_head = static_cast<const AttentionMixer&>(mixer).n_head();
    return site;
  }
  return nullptr;  // KDA, DeltaNet, linear attention: no softmax
}

}  // namespace

HybridModel::HybridModel(const HybridConfig& c, uint64_t seed, bool allocate, ExpertShard shard, PipelineStage stage)
    : c_(c), factory_(allocate, c.dtype, seed), stage_(stage) {
  MT_CHECK(!c.mixers.empty(), "hybrid model: no layers");
  MT_CHECK(c.dtype == DType::f32 || c.dtype == DType::f64, "hybrid model: dtype {} is not supported on the CPU",
           c.dtype);
  MT_CHECK(stage.count >= 1 && stage.chunks >= 1 && stage.virtual_count() <= c.n_layer() && stage.index >= 0 &&
               stage.index < stage.count,
           "hybrid model: pipeline stage {} of {}{} over {} layers (each stage needs at least one layer)", stage.index,
           stage.count, stage.chunks > 1 ? fmt::format(", {} virtual stages each", stage.chunks) : std::string(),
           c.n_layer());
  for (int64_t k = 0; k < stage.chunks; ++k) chunks_.push_back(moetrain::stage_layers(c.n_layer(), stage, k));
  MT_CHECK(c.vocab_pad_multiple >= 1, "hybrid model: vocab_pad_multiple = {} must be at least 1",
           c.vocab_pad_multiple);
  const int64_t D = c.d_model, V = c.vocab_size, Vp = c.padded_vocab_size();
  ParamFactory& f = factory_;
  // Declarations of other stages advance the generator only (ParamFactory::set_skipping).
  const bool has_table = stage.first() || (stage.last() && c.tie_embeddings);
  f.set_skipping(!has_table);
  // Padded (docs/model.md#padded-vocabulary): the table and the untied head draw
  // their V real rows as the unpadded model does (the generator advances by V D,
  // so every later parameter is the same too); the padding rows are 0.
  embed_tokens_ = f.make("model.embed_tokens.weight", {Vp, D}, Init::first_rows(Init::normal(c.embed_init_std), V),
                         "embedding", false);
  for (int64_t l = 0; l < c.n_layer(); ++l) {
    f.set_skipping(!holds_layer(l));
    const std::string p = fmt::format("model.layers.{}.", l);
    auto layer = std::make_unique<HybridLayer>();
    HybridLayer& L = *layer;
    L.index = l;
    L.input_layernorm = f.make(p + "input_layernorm.weight", {D}, Init::ones(), "norm", false);
    L.mixer = make_mixer(c.mixers[static_cast<size_t>(l)], c, f, p + "self_attn.");
    if (holds_layer(l)) L.site = qk_clip_site_of(*L.mixer, p + "self_attn.", l);
    L.post_attention_layernorm = f.make(p + "post_attention_layernorm.weight", {D}, Init::ones(), "norm", false);
    if (c.is_moe_layer(l)) {
      auto moe = std::make_unique<MoeLayer>(c.moe, D, c.ffn, c.init_std, f, p + "mlp.", shard);
      L.moe = moe.get();
      L.ffn = std::move(moe);
    } else {
      FfnConfig fc = c.ffn;
      fc.d_model = D;
      fc.init_std = c.init_std;
      L.ffn = std::make_unique<DenseFfn>(fc, f, p + "mlp.");
    }
    if (c.attn_res) {
      // Pseudo-queries start at zero (uniform read, docs/model.md#initialisation); key norms at one. Layer 0's
      // attention read never happens (nothing but the embedding exists), so it has none.
      if (l > 0) {
        L.attn_res_proj = f.make(p + "attn_res_proj.weight", {D}, Init::zeros(), "attn_res", false);
        L.attn_res_norm = f.make(p + "attn_res_norm.weight", {D}, Init::ones(), "attn_res", false);
      }
      L.mlp_res_proj = f.make(p + "mlp_res_proj.weight", {D}, Init::zeros(), "attn_res", false);
      L.mlp_res_norm = f.make(p + "mlp_res_norm.weight", {D}, Init::ones(), "attn_res", false);
    }
    layers_.push_back(std::move(layer));
  }
  f.set_skipping(!stage.last());
  if (c.attn_res) {
    out_res_proj_ = f.make("model.output_attn_res_proj.weight", {D}, Init::zeros(), "attn_res", false);
    out_res_norm_ = f.make("model.output_attn_res_norm.weight", {D}, Init::ones(), "attn_res", false);
  }
  norm_ = f.make("model.norm.weight", {D}, Init::ones(), "norm", false);
  if (!c.tie_embeddings) {
    const double s = 1.0 / std::sqrt(static_cast<double>(D));
    lm_head_ = f.make("lm_head.weight", {Vp, D}, Init::first_rows(Init::trunc_normal(s, -3, 3), V), "lm_head", true);
  }
  f.set_skipping(false);
  if (c.attn_res) stream_ = std::make_unique<BlockAttnRes>(c.attn_res_block_size);
  else stream_ = std::make_unique<PlainResidual>();
}

HybridModel::~HybridModel() = default;

std::string HybridModel::describe() const {
  int64_t kda = 0, mla = 0, attn = 0;
  std::map<std::string, int64_t> others;  // the other mixers of the evolution ladder, by name
  for (MixerKind m : c_.mixers) {
    if (m == MixerKind::kda) ++kda;
    else if (m == MixerKind::mla) ++mla;
    else if (m == MixerKind::attention) ++attn;
    else ++others[mixer_kind_name(m)];
  }
  std::string extra;
  for (const auto& [name, count] : others) extra += fmt::format(", {} {}", count, name);
  const std::string vocab = c_.padded_vocab_size() == c_.vocab_size
                                ? std::to_string(c_.vocab_size)
                                : fmt::format("{} (padded to {})", c_.vocab_size, c_.padded_vocab_size());
  return fmt::format("{} layers ({} kda, {} mla, {} attention{}), d_model {}, ffn {} {}, vocab {}, attn_res {}, {}",
                     c_.n_layer(), kda, mla, attn, extra, c_.d_model, ffn_kind_name(c_.ffn.kind), c_.ffn.d_ff,
                     vocab, c_.attn_res ? fmt::format("S={}", c_.attn_res_block_size) : std::string("off"),
                     dtype_name(c_.dtype));
}

Tensor HybridModel::run(const Tensor& ids, DecodeCache* dcache, bool training) {
  MT_CHECK(factory_.allocating(), "hybrid model: built with shapes only (ledger); it cannot run");
  MT_CHECK(stage_.whole(), "hybrid model: stage {} of a {}-stage pipeline holds layers [{}, {}){} only; forward, "
           "loss and decoding need the whole model", stage_.index, stage_.count, chunks_.front().first,
           chunks_.front().end, chunks_.size() > 1 ? " and more chunks" : "");
  MT_CHECK(ids.dim() == 2, "hybrid model: ids must be [B, T], got {}", ids.shape());
  HybridCache* cache = dcache ? dynamic_cast<HybridCache*>(dcache) : nullptr;
  MT_CHECK(!dcache || cache, "hybrid model: the decode cache belongs to another model");
  const int64_t T = ids.size(1), first = cache ? cache->tokens : 0;
  MT_CHECK(first + T <= c_.n_ctx, "hybrid model: {} tokens exceed model.n_ctx = {}", first + T, c_.n_ctx);
  if (cache && cache->mixers.empty())
    for (const auto& L : layers_) cache->mixers.push_back(L->mixer->new_cache());
  Tensor hidden;
  {
    profile::Region region("embedding/head");
    hidden = embedding(embed_tokens_, ids);  // [B, T, D]
  }
  aux_losses_.clear();
  Tensors state = run_layers({hidden}, 0, c_.n_layer(), dcache, training);
  if (cache) cache->tokens += T;
  return head(state);
}

Tensors HybridModel::run_layers(Tensors state, int64_t first, int64_t end, DecodeCache* dcache, bool training) {
  HybridCache* cache = dcache ? static_cast<HybridCache*>(dcache) : nullptr;
  // Recomputation (docs/training.md#activation-recomputation): each layer call runs
  // under checkpoint(), which keeps its input state and its outputs, and runs the
  // call again in backward. Decided with this forward's grad mode, as Gpt2 does.
  const bool recompute = c_.recompute && training && autograd::grad_enabled() && !cache;
  for (int64_t l = first; l < end; ++l) {
    const HybridLayer& L = *layers_[static_cast<size_t>(l)];
    LayerCall call;
    call.eps = c_.rms_norm_eps;
    call.training = training;
    call.cache = cache ? cache->mixers[static_cast<size_t>(l)].get() : nullptr;
    // The plain stream fuses the layer's last add with the next layer's input norm,
    // except after the range's last layer (the final norm or the next stage takes the
    // sum) and at recomputed layers' boundaries, where the state is one tensor
    // (add_rms_norm is add then rms_norm, bit for bit, docs/training.md#activation-recomputation).
    if (!c_.attn_res && !recompute && l + 1 < end)
      call.next_input_norm = layers_[static_cast<size_t>(l) + 1]->input_layernorm;
    LayerOutput out;
    if (recompute) {
      const ResidualStream* stream = stream_.get();
      const HybridLayer* layer = &L;
      Tensors outs = checkpoint(
          [stream, layer, call](const Tensors& in) {
            LayerOutput o = stream->layer(*layer, in, call);
            if (o.aux_loss.defined()) o.made.push_back(o.aux_loss);
            return o.made;
          },
          state);
      if (outs.size() > 1) {  // one state tensor under recomputation, then the aux loss if any
        out.aux_loss = outs.back();
        outs.pop_back();
      }
      out.made = std::move(outs);
    } else {
      out = stream_->layer(L, state, call);
    }
    if (out.aux_loss.defined()) aux_losses_.push_back(out.aux_loss);
    state = stream_->next_state(L, std::move(state), std::move(out.made));
  }
  return state;
}

Tensor HybridModel::head(const Tensors& state) {
  Tensor hidden = state.back();
  if (c_.attn_res) {
    profile::Region region("attnres");
    hidden = attn_res(state, out_res_proj_, out_res_norm_, c_.rms_norm_eps);
  }
  profile::Region region("embedding/head");
  return linear(rms_norm(hidden, norm_, c_.rms_norm_eps), c_.tie_embeddings ? embed_tokens_ : lm_head_);
}

// The real columns only: what sampling, evaluation and HF comparisons see.
Tensor HybridModel::without_padding(const Tensor& logits) const {
  if (c_.padded_vocab_size() == c_.vocab_size) return logits;
  profile::Region region("embedding/head");
  return slice(logits, 2, 0, c_.vocab_size);
}

bool HybridModel::holds_layer(int64_t l) const {
  for (const StageLayers& r : chunks_)
    if (l >= r.first && l < r.end) return true;
  return false;
}

StageLayers HybridModel::pipeline_stage_layers(int64_t chunk) const {
  MT_CHECK(chunk >= 0 && chunk < stage_.chunks, "hybrid model: chunk {} of {}", chunk, stage_.chunks);
  return chunks_[static_cast<size_t>(chunk)];
}

bool HybridModel::stage_holds(const std::string& name) const {
  if (stage_.whole()) return true;
  const std::string layer_prefix = "model.layers.";
  if (name.rfind(layer_prefix, 0) == 0)
    return holds_layer(std::strtoll(name.c_str() + layer_prefix.size(), nullptr, 10));
  if (name == "model.embed_tokens.weight") return stage_.first() || (stage_.last() && c_.tie_embeddings);
  return stage_.last();  // the final AttnRes read, norm and head
}

int64_t HybridModel::stage_input_count(int64_t chunk) const {
  const int64_t first = pipeline_stage_layers(chunk).first;
  if (first == 0) return 0;
  if (!c_.attn_res) return 1;
  const int64_t S = c_.attn_res_block_size;
  return (first + S - 1) / S + 1;  // blocks opened at layers 0, S, 2S, ... below `first`, then the open sum
}

StageOutput HybridModel::stage_forward(const Tensor& ids, const Tensors& inputs, const Tensor& targets, bool training,
                                       int64_t chunk) {
  MT_CHECK(factory_.allocating(), "hybrid model: built with shapes only (ledger); it cannot run");
  const StageLayers layers = pipeline_stage_layers(chunk);
  const int64_t g = stage_.virtual_index(chunk);  // this chunk's virtual stage
  const bool first = g == 0, last = g == stage_.virtual_count() - 1;
  MT_CHECK(static_cast<int64_t>(inputs.size()) == stage_input_count(chunk),
           "hybrid model: pipeline stage {} (layers [{}, {})) takes {} tensors from the previous stage, got {}", g,
           layers.first, layers.end, stage_input_count(chunk), inputs.size());
  Tensors state = inputs;
  if (first) {
    MT_CHECK(ids.dim() == 2, "hybrid model: ids must be [B, T], got {}", ids.shape());
    MT_CHECK(ids.size(1) <= c_.n_ctx, "hybrid model: {} tokens exceed model.n_ctx = {}", ids.size(1), c_.n_ctx);
    profile::Region region("embedding/head");
    state = {embedding(embed_tokens_, ids)};
  }
  for (const Tensor& t : state)
    MT_CHECK(t.dim() == 3 && t.size(2) == c_.d_model, "hybrid model: pipeline stage {} received {}, expected [B, T, "
             "{}]", g, t.shape(), c_.d_model);
  aux_losses_.clear();
  state = run_layers(std::move(state), layers.first, layers.end, nullptr, training);
  StageOutput out;
  // The MoE layers' aux losses added one by one after the cross-entropy, as loss() adds them.
  auto add_aux = [&](Tensor l) {
    for (const Tensor& aux : aux_losses_) l = l.defined() ? add(l, aux.to(l.dtype())) : aux;
    return l;
  };
  if (!last) {
    out.activations = std::move(state);
    out.loss = add_aux(Tensor());
    return out;
  }
  Tensor logits = head(state);  // [B, T, padded_vocab_size()]
  if (!targets.defined()) {
    out.logits = without_padding(logits);  // what the pipeline broadcasts: [B, T, vocab_size]
    return out;
  }
  profile::Region region("embedding/head");
  // bf16 logits as they are, an f32 loss over the vocab_size() real classes (the
  // padding columns outside the softmax); host targets checked before they move:
  // as LanguageModel::loss.
  if (logits.is_cuda() && !targets.is_cuda())
    check_cross_entropy_targets(targets, vocab_size(), -100, padded_vocab_size() - vocab_size());
  out.loss = add_aux(cross_entropy(logits, targets.to(logits.device()), -100, Reduction::mean, vocab_size()));
  return out;
}

Tensor HybridModel::forward(const Tensor& ids, bool training) { return without_padding(run(ids, nullptr, training)); }

Tensor HybridModel::forward_padded(const Tensor& ids, bool training) { return run(ids, nullptr, training); }

Tensor HybridModel::loss(const Tensor& ids, const Tensor& targets, bool training) {
  Tensor l = LanguageModel::loss(ids, targets, training);
  for (const Tensor& aux : aux_losses_) l = add(l, aux.to(l.dtype()));
  return l;
}

void HybridModel::set_expert_group(comm::Communicator* group) {
  for (MoeLayer* m : moe_layers()) m->set_expert_group(group);
}

std::vector<MoeLayer*> HybridModel::moe_layers() const {
  std::vector<MoeLayer*> out;
  for (const StageLayers& r : chunks_)
    for (int64_t l = r.first; l < r.end; ++l)
      if (MoeLayer* m = layers_[static_cast<size_t>(l)]->moe) out.push_back(m);
  return out;
}

void HybridModel::set_track_max_logits(bool on) {
  for (const auto& L : layers_) {
    if (!L->site) continue;
    QkClipSite* site = on ? L->site.get() : nullptr;
    if (L->mixer->kind() == MixerKind::mla) static_cast<MlaLayer&>(*L->mixer).record_max_logits(site);
    else static_cast<AttentionMixer&>(*L->mixer).record_max_logits(site);
  }
}

std::vector<QkClipSite*> HybridModel::qk_clip_sites() {
  std::vector<QkClipSite*> out;
  for (const auto& L : layers_)
    if (L->site) out.push_back(L->site.get());
  return out;
}

const Mixer& HybridModel::mixer(int64_t l) const {
  MT_CHECK(l >= 0 && l < c_.n_layer(), "hybrid model: layer {} of {}", l, c_.n_layer());
  return *layers_[static_cast<size_t>(l)]->mixer;
}

std::unique_ptr<DecodeCache> HybridModel::new_cache() const { return std::make_unique<HybridCache>(); }

Tensor HybridModel::forward_cached(const Tensor& ids, DecodeCache& cache) {
  NoGradGuard no_grad;
  return without_padding(run(ids, &cache, false));
}

double HybridModel::flops_per_token(int64_t T) const { return flops_per_token(T, 0, c_.n_layer(), true); }

double HybridModel::flops_per_token(int64_t T, int64_t first, int64_t end, bool head) const {
  // 6 x (active matrix parameters, LM head included, embedding table excluded)
  // plus each mixer's sequence terms (Mixer::sequence_flops_per_token). A padded
  // vocabulary's head GEMM runs over all padded_vocab_size() columns, so the head
  // counts Vp D (lm_head.weight's shape, or the tied table's).
  double matmul = 0;
  for (const ParamSpec& s : factory_.specs()) {
    if (s.group == "embedding" || s.shape.ndim() < 2) continue;
    const int64_t l = parameter_layer(s.name);
    if (l < 0 ? first > 0 : l >= c_.n_layer() ? !head : l < first || l >= end) continue;
    double n = static_cast<double>(s.shape.numel());
    if (s.group == "experts") n *= static_cast<double>(c_.moe.top_k) / static_cast<double>(c_.moe.num_experts);
    matmul += n;
  }
  if (head && c_.tie_embeddings) matmul += static_cast<double>(c_.padded_vocab_size() * c_.d_model);
  double seq = 0;
  for (int64_t l = first; l < end; ++l) seq += layers_[static_cast<size_t>(l)]->mixer->sequence_flops_per_token(T);
  return 6.0 * matmul + seq;
}

double HybridModel::selective_recompute_flops_per_token(int64_t first, int64_t end) const {
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  double elements = 0;
  for (const ParamSpec& s : factory_.specs()) {
    const int64_t l = parameter_layer(s.name);
    if (l < first || l >= end) continue;
    const double n = static_cast<double>(s.shape.numel());
    const double routed = static_cast<double>(c_.moe.top_k) / static_cast<double>(std::max<int64_t>(c_.moe.num_experts, 1));
    if (s.group == "experts") {
      if (c_.moe.recompute_experts) elements += n * routed;
      else if (c_.ffn.recompute_act && ends_with(s.name, "experts.w2.weight")) elements += n * routed;
    } else if (c_.ffn.recompute_act &&
               (ends_with(s.name, "mlp.down_proj.weight") || ends_with(s.name, "shared_experts.down_proj.weight"))) {
      elements += n;  // the dense FFN's and the shared experts' (not the latent routed_expert_down_proj)
    }
  }
  return 2.0 * elements;
}

int64_t HybridModel::parameter_layer(const std::string& name) const {
  static const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) == 0) return std::stoll(name.substr(prefix.size()));
  if (name == "model.embed_tokens.weight") return -1;
  return c_.n_layer();  // model.norm, model.output_attn_res_*, lm_head
}

int64_t HybridModel::boundary_values_per_token(int64_t layer) const {
  // Before layer l the block list holds the entries appended at l' < l with l' % S == 0
  // (docs/model.md#attnres-schedule); `hidden` carries the open block's partial sum.
  if (!c_.attn_res) return c_.d_model;
  const int64_t S = c_.attn_res_block_size;
  return ((layer + S - 1) / S + 1) * c_.d_model;
}

int64_t HybridModel::decode_cache_bytes(int64_t length) const {
  // What HybridCache holds for one sequence after `length` tokens (tested against it).
  int64_t n = 0;
  for (const auto& L : layers_) n += L->mixer->cache_bytes(length);
  return n;
}

double HybridModel::activation_bytes_per_token(bool mixed_precision) const {
  return activation_bytes_per_token(mixed_precision, 0, c_.n_layer(), true);
}

double HybridModel::activation_bytes_per_token(bool mixed_precision, int64_t first, int64_t end, bool head) const {
  // Rough: ~16 D-wide tensors per sublayer pair, the FFN hidden (3 F), KDA/MLA
  // intermediates (~12 P), AttnRes sources are shared; plus logits and their gradient.
  // In bf16 runs (mixed_precision) the wide tensors and the logits with their
  // gradient are bf16 (the cross-entropy reads bf16 logits); the KDA layer's
  // internals and the router's scores stay f32 (docs/model.md#mixed-precision).
  const double D = static_cast<double>(c_.d_model), F = static_cast<double>(c_.ffn.d_ff);
  const double P = static_cast<double>(c_.kda.value_heads() * c_.kda.head_dim);
  // The logits and their gradient span the padded vocabulary (the head's output).
  double wide = head ? 2.0 * static_cast<double>(c_.padded_vocab_size()) : 0.0, kept_f32 = 0;
  // MoE layers replace the dense FFN hidden by what their backward keeps per token:
  // the router's scores over all E (the sigmoid keeps its output; this term
  // dominates at many experts and small widths), per routed slot the dispatched
  // row, its gate/up/activation [3 F] and the expert output, combined and weighted
  // rows (5 W), the latent down/up/norm (~4 W + D) and the shared experts' hidden
  // (3 F each).
  const MoeConfig& m = c_.moe;
  const double E = static_cast<double>(m.num_experts), k = static_cast<double>(m.top_k);
  const double Fe = static_cast<double>(m.expert_d_ff);
  const double W = static_cast<double>(m.latent_dim > 0 ? m.latent_dim : c_.d_model);
  // Selective recomputation keeps no activation (train.recompute_modules act: one F
  // of the three) or nothing of a routed expert's hidden (experts).
  const double hidden = c_.ffn.recompute_act ? 2.0 : 3.0;
  const double expert_hidden = m.recompute_experts ? 0.0 : hidden;
  for (int64_t l = first; l < end; ++l) {
    wide += 16.0 * D + hidden * F;
    kept_f32 += 12.0 * P;
    if (c_.is_moe_layer(l)) {
      wide += k * (5.0 * W + expert_hidden * Fe) + 4.0 * W + D +
              hidden * Fe * static_cast<double>(m.num_shared_experts) - hidden * F;
      kept_f32 += E;
    }
  }
  if (mixed_precision) return wide * 2.0 + kept_f32 * 4.0;
  return (wide + kept_f32) * static_cast<double>(dtype_size(c_.dtype));
}

}  // namespace moetrain
