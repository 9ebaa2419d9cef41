// GPT-2 forward (docs/model.md#gpt-2-block). Shapes: ids [B, T]; x [B, T, D]; per head
// [B, T, H, D/H]. Everything is built from differentiable ops, so backward is
// the ops' backward (each gradient-checked in tests/ops).
#include "nn/gpt2.h"

#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "autograd/engine.h"
#include "core/grad_mode.h"
#include "core/profile.h"
#include "core/rng.h"
#include "ops/attention/attention.h"
#include "ops/dropout/dropout.h"
#include "ops/elementwise/elementwise.h"
#include "ops/embedding/embedding.h"
#include "ops/linalg/linalg.h"
#include "ops/norm/norm.h"
#include "ops/softmax/softmax.h"
#include "ops/view/view.h"

namespace moetrain {

Gpt2::Gpt2(const Gpt2Config& c, uint64_t seed, bool allocate) : config_(c), factory_(allocate, c.dtype, seed) {
  MT_CHECK(c.d_model % c.n_head == 0, "gpt2: d_model = {} is not divisible by n_head = {}", c.d_model, c.n_head);
  MT_CHECK(c.dtype == DType::f32 || c.dtype == DType::f64, "gpt2: dtype {} is not supported on the CPU", c.dtype);
  const int64_t D = c.d_model, F = c.d_ff;
  const double resid_std = c.init_std / std::sqrt(2.0 * static_cast<double>(c.n_layer));
  ParamFactory& f = factory_;
  const Init w = Init::normal(c.init_std), resid = Init::normal(resid_std), zero = Init::zeros(), one = Init::ones();

  MT_CHECK(c.vocab_pad_multiple >= 1, "gpt2: vocab_pad_multiple = {} must be at least 1", c.vocab_pad_multiple);
  const int64_t V = c.vocab_size, Vp = c.padded_vocab_size();
  // Padded (docs/model.md#padded-vocabulary): the real rows drawn as the unpadded
  // model draws them (the generator advances by V D, so every later parameter is
  // the same too), the padding rows 0.
  wte_ = f.make("wte.weight", {Vp, D}, Init::first_rows(w, V), "embedding", false);
  wpe_ = f.make("wpe.weight", {c.n_ctx, D}, w, "embedding", false);
  for (int64_t l = 0; l < c.n_layer; ++l) {
    std::string p = "h." + std::to_string(l) + ".";
    Block b;
    b.ln1_w = f.make(p + "ln_1.weight", {D}, one, "norm", false);
    b.ln1_b = f.make(p + "ln_1.bias", {D}, zero, "norm", false);
    b.attn_w = f.make(p + "attn.c_attn.weight", {3 * D, D}, w, "attention", true);
    b.attn_b = f.make(p + "attn.c_attn.bias", {3 * D}, zero, "attention", false);
    b.attn_proj_w = f.make(p + "attn.c_proj.weight", {D, D}, resid, "attention", true);
    b.attn_proj_b = f.make(p + "attn.c_proj.bias", {D}, zero, "attention", false);
    b.ln2_w = f.make(p + "ln_2.weight", {D}, one, "norm", false);
    b.ln2_b = f.make(p + "ln_2.bias", {D}, zero, "norm", false);
    b.fc_w = f.make(p + "mlp.c_fc.weight", {F, D}, w, "mlp", true);
    b.fc_b = f.make(p + "mlp.c_fc.bias", {F}, zero, "mlp", false);
    b.mlp_proj_w = f.make(p + "mlp.c_proj.weight", {D, F}, resid, "mlp", true);
    b.mlp_proj_b = f.make(p + "mlp.c_proj.bias", {D}, zero, "mlp", false);
    blocks_.push_back(b);
  }
  lnf_w_ = f.make("ln_f.weight", {D}, one, "norm", false);
  lnf_b_ = f.make("ln_f.bias", {D}, zero, "norm", false);
  sites_.resize(static_cast<size_t>(c.n_layer));
  for (int64_t l = 0; l < c.n_layer; ++l) {
    QkClipSite& s = sites_[static_cast<size_t>(l)];
    const std::string p = "h." + std::to_string(l) + ".";
    s.layout = QkClipSite::Layout::fused_qkv;
    s.q_weight = p + "attn.c_attn.weight";
    s.q_bias = p + "attn.c_attn.bias";
    s.n_head = c.n_head;
    s.layer = "layers." + std::to_string(l);
  }
}

std::vector<QkClipSite*> Gpt2::qk_clip_sites() {
  std::vector<QkClipSite*> out;
  for (QkClipSite& s : sites_) out.push_back(&s);
  return out;
}

// x0 = wte[ids] + wpe[positions]
Tensor Gpt2::embed(const Tensor& ids, int64_t first_position, bool training) {
  MT_CHECK(ids.dim() == 2, "gpt2: ids must be [B, T], got {}", moetrain::describe(ids));
  int64_t T = ids.size(1);
  MT_CHECK(first_position + T <= config_.n_ctx,
           "gpt2: positions {}..{} exceed the context of {} (model.n_ctx); use shorter sequences", first_position,
           first_position + T - 1, config_.n_ctx);
  profile::Region region("embedding/head");
  Tensor x = add(embedding(wte_, ids), slice(wpe_, 0, first_position, first_position + T));
  return dropout(x, training ? config_.dropout : 0.0);
}

Gpt2BlockParts gpt2_block_parts(const Gpt2BlockWeights& b, const Tensor& x, const Tensor& ln1, int64_t n_head,
                                double eps, double p, Tensor* k_cache, Tensor* v_cache, QkClipSite* site) {
  MT_CHECK(x.dim() == 3 && n_head >= 1 && x.size(2) % n_head == 0,
           "gpt2_block: x {} must be [B, T, D] with D divisible by n_head = {}", x.shape(), n_head);
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), H = n_head, hd = D / H;
  // Attention: qkv = LN_1(x) W_attn^T + b, split into q | k | v, per head [B, T, H, hd].
  std::optional<profile::Region> region(std::in_place, "attention");
  Tensor qkv = linear(ln1, b.attn_w, b.attn_b);  // [B, T, 3D]
  Tensors parts = split(qkv, {D, D, D}, -1);
  Tensor q = reshape(parts[0], {B, T, H, hd}), k = reshape(parts[1], {B, T, H, hd}),
         v = reshape(parts[2], {B, T, H, hd});
  if (k_cache) {
    if (k_cache->defined()) {
      k = concat({*k_cache, k}, 1);
      v = concat({*v_cache, v}, 1);
    }
    *k_cache = k;
    *v_cache = v;
  }
  Tensor max_logit;  // [H], when QK-Clip records (nn/language_model.h)
  Tensor o = reshape(
      causal_attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(hd)), site ? &max_logit : nullptr), {B, T, D});
  if (site) fold_max_logit(*site, max_logit);
  Tensor attn = dropout(linear(o, b.attn_proj_w, b.attn_proj_b), p);
  // MLP: x + gelu(LN_2(h) W_fc^T + b_fc) W_proj^T + b_proj; h = x + attn and LN_2(h) in one op.
  region.reset();
  region.emplace("mlp");
  ResidualNorm h = add_layer_norm(x, attn, b.ln2_w, b.ln2_b, eps);
  Tensor m = mlp_gelu(h.normed, b.fc_w, b.fc_b, b.mlp_proj_w, b.mlp_proj_b);  // one op
  return {h.sum, dropout(m, p)};
}

Tensor gpt2_block(const Gpt2BlockWeights& b, const Tensor& x, int64_t n_head, double eps, double p,
                  Tensor* k_cache, Tensor* v_cache, QkClipSite* site) {
  MT_CHECK(x.dim() == 3, "gpt2_block: x {} must be [B, T, D]", x.shape());
  Tensor ln1;
  {
    profile::Region region("attention");
    ln1 = layer_norm(x, b.ln1_w, b.ln1_b, eps);
  }
  Gpt2BlockParts out = gpt2_block_parts(b, x, ln1, n_head, eps, p, k_cache, v_cache, site);
  return add(out.h, out.mlp_delta);
}

Tensor Gpt2::block_forward(const Block& b, const Tensor& x, bool training, Tensor* k_cache, Tensor* v_cache,
                           QkClipSite* site) {
  return gpt2_block(b, x, config_.n_head, config_.layer_norm_eps, training ? config_.dropout : 0.0, k_cache,
                    v_cache, site);
}

// The blocks on the embeddings x, then LN_f: x_{l+1} = h_l + mlp_l is formed by
// add_layer_norm together with LN_1 of block l + 1, or LN_f after the last block
// (docs/cuda.md, "Fused residual add and norm"). Returns LN_f(x_L).
Tensor Gpt2::blocks_then_final_norm(Tensor x, bool training, Gpt2Cache* cache) {
  const double eps = config_.layer_norm_eps, p = training ? config_.dropout : 0.0;
  if (blocks_.empty()) {
    profile::Region region("embedding/head");
    return layer_norm(x, lnf_w_, lnf_b_, eps);
  }
  Tensor normed;
  {
    profile::Region region("attention");
    normed = layer_norm(x, blocks_[0].ln1_w, blocks_[0].ln1_b, eps);
  }
  const bool record = recording();
  for (size_t l = 0; l < blocks_.size(); ++l) {
    Tensor* k_cache = cache ? &cache->k[l] : nullptr;
    Tensor* v_cache = cache ? &cache->v[l] : nullptr;
    QkClipSite* site = record ? &sites_[l] : nullptr;
    Gpt2BlockParts out = gpt2_block_parts(blocks_[l], x, normed, config_.n_head, eps, p, k_cache, v_cache, site);
    const bool last = l + 1 == blocks_.size();
    profile::Region region(last ? "embedding/head" : "attention");
    ResidualNorm next = add_layer_norm(out.h, out.mlp_delta, last ? lnf_w_ : blocks_[l + 1].ln1_w,
                                       last ? lnf_b_ : blocks_[l + 1].ln1_b, eps);
    x = next.sum;
    normed = next.normed;
  }
  return normed;
}

// logits = LN_f(x) wte^T (tied head), from LN_f(x), over the padded vocabulary
Tensor Gpt2::head(const Tensor& final_normed) {
  profile::Region region("embedding/head");
  return linear(final_normed, wte_);
}

// The real columns only: what sampling, evaluation and HF comparisons see.
Tensor Gpt2::without_padding(const Tensor& logits) const {
  if (config_.padded_vocab_size() == config_.vocab_size) return logits;
  profile::Region region("embedding/head");
  return slice(logits, 2, 0, config_.vocab_size);
}

Tensor Gpt2::forward(const Tensor& ids, bool training) { return without_padding(forward_padded(ids, training)); }

Tensor Gpt2::forward_padded(const Tensor& ids, bool training) {
  Tensor x = embed(ids, 0, training);
  if (!(config_.activation_checkpointing && training)) return head(blocks_then_final_norm(x, training, nullptr));
  // Checkpointed blocks keep one tensor, x, at each boundary: the add between
  // blocks stays unfused there (the same values: add_layer_norm is add then
  // layer_norm, bit for bit on the CPU).
  // Decided here, with this forward's grad mode: checkpoint() runs the blocks
  // without grad, then again with grad in backward (which folds the same maxima again).
  const bool record = recording();
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Block& b = blocks_[l];
    QkClipSite* site = record ? &sites_[l] : nullptr;
    x = checkpoint(
        [this, &b, site](const Tensors& in) { return Tensors{block_forward(b, in[0], true, nullptr, nullptr, site)}; },
        {x})[0];
  }
  Tensor normed;
  {
    profile::Region region("embedding/head");
    normed = layer_norm(x, lnf_w_, lnf_b_, config_.layer_norm_eps);
  }
  return head(normed);
}

int64_t Gpt2Cache::bytes() const {
  int64_t n = 0;
  for (size_t l = 0; l < k.size(); ++l)
    if (k[l].defined()) n += k[l].nbytes() + v[l].nbytes();
  return n;
}

std::string Gpt2::describe() const {
  const Gpt2Config& c = config_;
  const std::string vocab = c.padded_vocab_size() == c.vocab_size
                                ? std::to_string(c.vocab_size)
                                : fmt::format("{} (padded to {})", c.vocab_size, c.padded_vocab_size());
  return fmt::format("{} layers, {} heads, d_model {}, d_ff {}, n_ctx {}, vocab {}, {}", c.n_layer, c.n_head, c.d_model,
                     c.d_ff, c.n_ctx, vocab, dtype_name(c.dtype));
}

Tensor Gpt2::forward_cached(const Tensor& ids, DecodeCache& cache) {
  auto* c = dynamic_cast<Gpt2Cache*>(&cache);
  MT_CHECK(c != nullptr, "gpt2: the decode cache belongs to another model");
  return forward_cached(ids, *c);
}

int64_t Gpt2::decode_cache_bytes(int64_t length) const {
  return 2 * config_.n_layer * length * config_.d_model * dtype_size(config_.dtype);  // K and V per layer
}

double Gpt2::activation_bytes_per_token(bool mixed_precision) const {
  return activation_bytes_per_token(mixed_precision, 0, config_.n_layer, true);
}

double Gpt2::activation_bytes_per_token(bool mixed_precision, int64_t first, int64_t end, bool head) const {
  const Gpt2Config& c = config_;
  const double size = static_cast<double>(dtype_size(c.dtype));
  const double blocks = static_cast<double>(end - first) *
                        (13.0 * static_cast<double>(c.d_model) + 2.0 * static_cast<double>(c.d_ff));
  // Logits and their gradient over the padded vocabulary; bf16 in bf16 runs (the
  // cross-entropy reads bf16 logits and writes a bf16 gradient, docs/cuda.md#mixed-precision).
  const double logits = head ? 2.0 * static_cast<double>(c.padded_vocab_size()) : 0.0;
  return mixed_precision ? (blocks + logits) * 2.0 : (blocks + logits) * size;
}

int64_t Gpt2::parameter_layer(const std::string& name) const {
  if (name.rfind("h.", 0) == 0) return std::stoll(name.substr(2));
  if (name == "wte.weight" || name == "wpe.weight") return -1;
  return config_.n_layer;  // ln_f
}

Tensor Gpt2::forward_cached(const Tensor& ids, Gpt2Cache& cache) {
  NoGradGuard no_grad;
  if (cache.k.empty()) {
    cache.k.resize(static_cast<size_t>(config_.n_layer));
    cache.v.resize(static_cast<size_t>(config_.n_layer));
  }
  Tensor normed = blocks_then_final_norm(embed(ids, cache.tokens, false), false, &cache);
  cache.tokens += ids.size(1);
  return without_padding(head(normed));
}

double Gpt2::flops_per_token(int64_t seq_len) const { return flops_per_token(seq_len, 0, config_.n_layer, true); }

double Gpt2::flops_per_token(int64_t seq_len, int64_t first, int64_t end, bool head) const {
  // 6 N over the parameters of the range (the tied wte counted once, with the head
  // that multiplies by it; wpe with block 0), plus 6 T D per block.
  int64_t n = 0;
  for (const ParamSpec& s : factory_.specs()) {
    const int64_t l = s.name == "wte.weight" ? config_.n_layer : parameter_layer(s.name);
    if (l < 0 ? first == 0 : l >= config_.n_layer ? head : l >= first && l < end) n += s.shape.numel();
  }
  return 6.0 * static_cast<double>(n) + 6.0 * static_cast<double>((end - first) * seq_len * config_.d_model);
}

}  // namespace moetrain
