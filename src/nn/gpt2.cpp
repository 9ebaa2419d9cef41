// GPT-2 forward (MODEL_SPEC §2). Shapes: ids [B, T]; x [B, T, D]; per head
// [B, T, H, D/H]. Everything is built from differentiable ops, so backward is
// the ops' backward (each gradient-checked in tests/ops).
#include "nn/gpt2.h"

#include <cmath>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "core/rng.h"
#include "ops/attention.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/linalg.h"
#include "ops/norm.h"
#include "ops/softmax.h"
#include "ops/view.h"

namespace moetrain {

Gpt2::Gpt2(const Gpt2Config& c, uint64_t seed) : config_(c) {
  MT_CHECK(c.d_model % c.n_head == 0, "gpt2: d_model = {} is not divisible by n_head = {}", c.d_model, c.n_head);
  MT_CHECK(c.dtype == DType::f32 || c.dtype == DType::f64, "gpt2: dtype {} is not supported on the CPU", c.dtype);
  Generator gen(seed);
  const int64_t D = c.d_model, F = c.d_ff;
  const double resid_std = c.init_std / std::sqrt(2.0 * static_cast<double>(c.n_layer));
  auto param = [&](const std::string& name, Tensor t, bool decay, const char* group) {
    t.set_requires_grad(true);
    params_.push_back({name, t, decay, group});
    return t;
  };
  auto normal = [&](Shape s, double std) { return randn(s, c.dtype, gen, 0.0, std); };
  auto zero = [&](Shape s) { return zeros(s, c.dtype); };
  auto one = [&](Shape s) { return ones(s, c.dtype); };

  wte_ = param("wte.weight", normal({c.vocab_size, D}, c.init_std), false, "embedding");
  wpe_ = param("wpe.weight", normal({c.n_ctx, D}, c.init_std), false, "embedding");
  for (int64_t l = 0; l < c.n_layer; ++l) {
    std::string p = "h." + std::to_string(l) + ".";
    Block b;
    b.ln1_w = param(p + "ln_1.weight", one({D}), false, "norm");
    b.ln1_b = param(p + "ln_1.bias", zero({D}), false, "norm");
    b.attn_w = param(p + "attn.c_attn.weight", normal({3 * D, D}, c.init_std), true, "attention");
    b.attn_b = param(p + "attn.c_attn.bias", zero({3 * D}), false, "attention");
    b.attn_proj_w = param(p + "attn.c_proj.weight", normal({D, D}, resid_std), true, "attention");
    b.attn_proj_b = param(p + "attn.c_proj.bias", zero({D}), false, "attention");
    b.ln2_w = param(p + "ln_2.weight", one({D}), false, "norm");
    b.ln2_b = param(p + "ln_2.bias", zero({D}), false, "norm");
    b.fc_w = param(p + "mlp.c_fc.weight", normal({F, D}, c.init_std), true, "mlp");
    b.fc_b = param(p + "mlp.c_fc.bias", zero({F}), false, "mlp");
    b.mlp_proj_w = param(p + "mlp.c_proj.weight", normal({D, F}, resid_std), true, "mlp");
    b.mlp_proj_b = param(p + "mlp.c_proj.bias", zero({D}), false, "mlp");
    blocks_.push_back(b);
  }
  lnf_w_ = param("ln_f.weight", one({D}), false, "norm");
  lnf_b_ = param("ln_f.bias", zero({D}), false, "norm");
}

// x0 = wte[ids] + wpe[positions]
Tensor Gpt2::embed(const Tensor& ids, int64_t first_position, bool training) {
  MT_CHECK(ids.dim() == 2, "gpt2: ids must be [B, T], got {}", describe(ids));
  int64_t T = ids.size(1);
  MT_CHECK(first_position + T <= config_.n_ctx,
           "gpt2: positions {}..{} exceed the context of {} (model.n_ctx); use shorter sequences", first_position,
           first_position + T - 1, config_.n_ctx);
  Tensor x = add(embedding(wte_, ids), slice(wpe_, 0, first_position, first_position + T));
  return dropout(x, training ? config_.dropout : 0.0);
}

Tensor Gpt2::block_forward(const Block& b, const Tensor& x, bool training, Tensor* k_cache, Tensor* v_cache) {
  const int64_t B = x.size(0), T = x.size(1), D = config_.d_model, H = config_.n_head, hd = config_.head_dim();
  const double eps = config_.layer_norm_eps, p = training ? config_.dropout : 0.0;
  // Attention: qkv = LN_1(x) W_attn^T + b, split into q | k | v, per head [B, T, H, hd].
  Tensor qkv = linear(layer_norm(x, b.ln1_w, b.ln1_b, eps), b.attn_w, b.attn_b);  // [B, T, 3D]
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
  Tensor o = reshape(causal_attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(hd))), {B, T, D});
  Tensor h = add(x, dropout(linear(o, b.attn_proj_w, b.attn_proj_b), p));
  // MLP: x + gelu(LN_2(h) W_fc^T + b_fc) W_proj^T + b_proj
  Tensor m = gelu_tanh(linear(layer_norm(h, b.ln2_w, b.ln2_b, eps), b.fc_w, b.fc_b));
  return add(h, dropout(linear(m, b.mlp_proj_w, b.mlp_proj_b), p));
}

// logits = LN_f(x) wte^T (tied head)
Tensor Gpt2::head(const Tensor& x) {
  return linear(layer_norm(x, lnf_w_, lnf_b_, config_.layer_norm_eps), wte_);
}

Tensor Gpt2::forward(const Tensor& ids, bool training) {
  Tensor x = embed(ids, 0, training);
  for (const Block& b : blocks_) {
    if (config_.activation_checkpointing && training) {
      x = checkpoint([this, &b](const Tensors& in) { return Tensors{block_forward(b, in[0], true, nullptr, nullptr)}; },
                     {x})[0];
    } else {
      x = block_forward(b, x, training, nullptr, nullptr);
    }
  }
  return head(x);
}

Tensor Gpt2::loss(const Tensor& ids, const Tensor& targets, bool training) {
  return cross_entropy(forward(ids, training), targets);
}

Tensor Gpt2::forward_cached(const Tensor& ids, Gpt2Cache& cache) {
  NoGradGuard no_grad;
  if (cache.k.empty()) {
    cache.k.resize(static_cast<size_t>(config_.n_layer));
    cache.v.resize(static_cast<size_t>(config_.n_layer));
  }
  Tensor x = embed(ids, cache.length, false);
  for (size_t l = 0; l < blocks_.size(); ++l) x = block_forward(blocks_[l], x, false, &cache.k[l], &cache.v[l]);
  cache.length += ids.size(1);
  return head(x);
}

double Gpt2::flops_per_token(int64_t seq_len) const {
  return 6.0 * static_cast<double>(count_parameters(params_)) +
         6.0 * static_cast<double>(config_.n_layer * seq_len * config_.d_model);
}

}  // namespace moetrain
