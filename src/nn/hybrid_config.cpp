// HybridConfig from the resolved YAML config (keys documented in src/config/schema.cpp).
#include <algorithm>

#include <fmt/format.h>

#include "config/config.h"
#include "nn/hybrid.h"

namespace moetrain {

HybridConfig HybridConfig::from(const Config& config) {
  HybridConfig c;
  c.vocab_size = config.get_int("model.vocab_size");
  c.vocab_pad_multiple = config.get_int("model.vocab_pad_multiple");  // >= 1 (the schema)
  c.d_model = config.get_int("model.d_model");
  c.n_ctx = config.get_int("model.n_ctx");
  const int64_t n_layer = config.get_int("model.n_layer");
  try {
    c.mixers = mixer_schedule(n_layer, config.get_string("model.layer_mixers"),
                              parse_mixer_kind(config.get_string("model.mixer")),
                              parse_mixer_kind(config.get_string("model.attn_mixer")),
                              config.get_int("model.attn_every"), config.get_int("model.attn_offset"),
                              config.get_bool("model.attn_last"));
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    config.fail("model.layer_mixers", e.what());
  }
  c.attention_n_head = config.get_int("model.n_head");

  c.kda.n_head = config.get_int("model.kda.n_head");
  c.kda.n_value_head = config.get_int("model.kda.n_value_head");
  c.kda.head_dim = config.get_int("model.kda.head_dim");
  c.kda.conv_size = config.get_int("model.kda.conv_size");
  c.kda.gate = config.get_string("model.kda.gate") == "softplus" ? KdaGate::softplus : KdaGate::lower_bound;
  c.kda.lower_bound = config.get_number("model.kda.lower_bound");
  c.kda.dt_bias_init =
      config.get_string("model.kda.dt_bias_init") == "zero" ? KdaDtBiasInit::zero : KdaDtBiasInit::spread;
  c.kda.full_rank_output_gate = config.get_bool("model.kda.full_rank_output_gate");
  c.kda.chunked = config.get_string("model.kda.mode") == "chunked";
  c.kda.chunk_size = config.get_int("model.kda.chunk_size");
  if (c.kda.value_heads() % c.kda.n_head != 0)
    config.fail("model.kda.n_value_head", fmt::format("must be a multiple of model.kda.n_head = {}", c.kda.n_head));

  c.mla.n_head = config.get_int("model.mla.n_head");
  c.mla.q_lora_rank = config.get_int("model.mla.q_lora_rank");
  c.mla.kv_lora_rank = config.get_int("model.mla.kv_lora_rank");
  c.mla.qk_nope_head_dim = config.get_int("model.mla.qk_nope_head_dim");
  c.mla.qk_rope_head_dim = config.get_int("model.mla.qk_rope_head_dim");
  c.mla.v_head_dim = config.get_int("model.mla.v_head_dim");
  c.mla.output_gate = config.get_bool("model.mla.output_gate");
  c.mla.rope = config.get_bool("model.mla.rope");
  c.mla.rope_theta = config.get_number("model.mla.rope_theta");
  c.mla.lora_norm_eps = config.get_number("model.mla.lora_norm_eps");
  const bool has_mla = std::find(c.mixers.begin(), c.mixers.end(), MixerKind::mla) != c.mixers.end();
  if (has_mla && c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim == 0)
    config.fail("model.mla.qk_nope_head_dim", "and model.mla.qk_rope_head_dim are both 0: MLA's query/key heads would "
                                              "have no dimensions; give one of them a positive size");
  if (c.mla.rope && c.mla.qk_rope_head_dim % 2 != 0)
    config.fail("model.mla.qk_rope_head_dim", "must be even when model.mla.rope is true");

  c.ffn.d_ff = config.get_int("model.d_ff");
  if (c.ffn.d_ff == 0) c.ffn.d_ff = 4 * c.d_model;
  c.ffn.kind = parse_ffn_kind(config.get_string("model.ffn"));
  c.ffn.situ_beta = config.get_number("model.situ_beta");
  c.ffn.situ_linear_beta = config.get_number("model.situ_linear_beta");
  c.ffn.situ_learnable_beta = config.get_bool("model.situ_learnable_beta");

  c.moe.num_experts = config.get_int("model.moe.num_experts");
  c.moe.top_k = config.get_int("model.moe.top_k");
  c.moe.num_shared_experts = config.get_int("model.moe.num_shared_experts");
  c.moe.expert_d_ff = config.get_int("model.moe.expert_d_ff");
  c.moe.latent_dim = config.get_int("model.moe.latent_dim");
  c.moe.latent_norm = config.get_bool("model.moe.latent_norm");
  c.moe.first_dense_layers = config.get_int("model.moe.first_dense_layers");
  c.moe.score = parse_router_score(config.get_string("model.moe.router_score"));
  c.moe.renormalize = config.get_bool("model.moe.renormalize");
  c.moe.routed_scaling_factor = config.get_number("model.moe.routed_scaling_factor");
  c.moe.n_group = config.get_int("model.moe.n_group");
  c.moe.topk_group = config.get_int("model.moe.topk_group");
  c.moe.bias_update_rate = config.get_number("model.moe.bias_update_rate");
  c.moe.aux_loss_weight = config.get_number("model.moe.aux_loss_weight");
  c.moe.z_loss_weight = config.get_number("model.moe.z_loss_weight");
  c.moe.capacity_factor = config.get_number("model.moe.capacity_factor");
  if (c.moe.num_experts > 0) {
    if (c.moe.first_dense_layers >= n_layer)
      config.fail("model.moe.first_dense_layers",
                  fmt::format("= {} keeps every one of the model.n_layer = {} layers dense, so model.moe.num_experts = "
                              "{} would build no MoE layer; lower it below model.n_layer or set model.moe.num_experts: 0",
                              c.moe.first_dense_layers, n_layer, c.moe.num_experts));
    if (c.moe.top_k > c.moe.num_experts)
      config.fail("model.moe.top_k", fmt::format("exceeds model.moe.num_experts = {}", c.moe.num_experts));
    if (c.moe.expert_d_ff == 0) config.fail("model.moe.expert_d_ff", "must be set (> 0) when model.moe.num_experts > 0");
    if (c.moe.num_experts % c.moe.n_group != 0)
      config.fail("model.moe.n_group", fmt::format("does not divide model.moe.num_experts = {}", c.moe.num_experts));
    if (c.moe.topk_group > c.moe.n_group || c.moe.top_k > c.moe.topk_group * (c.moe.num_experts / c.moe.n_group))
      config.fail("model.moe.topk_group",
                  fmt::format("must be <= model.moe.n_group = {} and keep at least model.moe.top_k = {} experts ({} "
                              "per group)", c.moe.n_group, c.moe.top_k, c.moe.num_experts / c.moe.n_group));
    if (c.ffn.kind == FfnKind::gelu)
      config.fail("model.ffn", "MoE experts are gated MLPs; use situ_glu or swiglu with model.moe.num_experts > 0");
  }

  c.attn_res = config.get_bool("model.attn_res");
  c.attn_res_block_size = config.get_int("model.attn_res_block_size");
  c.tie_embeddings = config.get_bool("model.tie_embeddings");
  c.rms_norm_eps = config.get_number("model.rms_norm_eps");
  c.init_std = config.get_number("model.init_std");
  c.embed_init_std = config.get_number("model.embed_init_std");
  // bf16 (mixed precision) builds the model in f32; the trainer converts it (docs/cuda.md).
  c.dtype = config.get_string("train.dtype") == "f64" ? DType::f64 : DType::f32;
  c.recompute = config.get_bool("train.activation_checkpointing");
  // Selective recomputation: the modules named (docs/training.md#activation-recomputation).
  for (const std::string& name : split_comma_list(config.get_string("train.recompute_modules"))) {
    if (name == "act") c.ffn.recompute_act = true;
    else if (name == "experts") c.moe.recompute_experts = true;
    else
      config.fail("train.recompute_modules",
                  fmt::format("'{}' is not a module that can be recomputed: act (the FFN activations, with the "
                              "down-projections), experts (the routed experts' MLPs); a comma list of them",
                              name));
  }
  return c;
}

}  // namespace moetrain
