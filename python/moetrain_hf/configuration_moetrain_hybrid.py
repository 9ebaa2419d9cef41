# coding=utf-8
"""Configuration of moetrain's hybrid decoder (model_type "moetrain_hybrid") for Hugging Face
transformers, loaded with trust_remote_code=True. moetrain (https://github.com/ -- the
repository's python/moetrain_hf/) copies this file beside every moetrain_hybrid export.

The fields are those `moetrain export` writes into config.json (docs/export.md, "The hybrid"):
Kimi-Linear's KimiLinearConfig fields plus what they cannot express, under "moetrain".
Nothing here guesses: a config.json written by moetrain is read as written, and the
properties below (mixers, kda_*, ...) derive the per-layer plan from it exactly as moetrain's
importer (src/nn/hybrid_hf.cpp, read_hybrid_hf_config) does.
"""
try:  # transformers >= 5 spells it PreTrainedConfig; both names exist there
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as _BaseConfig


class MoetrainHybridConfig(_BaseConfig):
    model_type = "moetrain_hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=256,
                 hidden_act="silu", activation_situ_beta=4.0, activation_situ_linear_beta=None,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=1024,
                 layer_types=None, mlp_layer_types=None,
                 num_attention_heads=4, num_key_value_heads=None, q_lora_rank=None, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True,
                 mla_use_output_gate=False, mla_rope_theta=None, attention_bias=False, attention_dropout=0.0,
                 linear_attn_config=None, attn_res_block_size=None,
                 num_experts=None, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=64,
                 routed_expert_hidden_size=None, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
                 moe_renormalize=True, routed_scaling_factor=1.0, use_grouped_topk=False, num_expert_group=1,
                 topk_group=1, topk_method="noaux_tc", first_k_dense_replace=None, moe_layer_freq=1,
                 num_nextn_predict_layers=0, moetrain=None, kda_mode="chunked", kda_chunk_size=64,
                 initializer_range=0.02, use_cache=True, **kwargs):
        # rope_theta: config.json's name; transformers 5 may fold it into rope_parameters, so
        # the MLA's theta is kept under its own name too.
        rope_theta = kwargs.pop("rope_theta", None)
        self.mla_rope_theta = float(mla_rope_theta if mla_rope_theta is not None else
                                    rope_theta if rope_theta is not None else 10000.0)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.linear_attn_config = dict(linear_attn_config or {})
        self.attn_res_block_size = attn_res_block_size
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.topk_method = topk_method
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.moetrain = dict(moetrain or {})
        # Prefill form of the KDA-family recurrences: "chunked" (fla's chunk form, exact up to
        # f32 rounding) or "recurrent" (one token at a time, as moetrain's recurrent kernel).
        self.kda_mode = kda_mode
        self.kda_chunk_size = kda_chunk_size
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        if layer_types is None:
            layer_types = self._default_layer_types()
        # The mixers live in moetrain.layer_mixers (moetrain writes it); layer_types keeps
        # only the two names transformers 5 accepts (it validates them): full_attention for
        # MLA and attention, linear_attention for the recurrent mixers.
        if not self.moetrain.get("layer_mixers"):
            self.moetrain["layer_mixers"] = ["kda" if t == "linear_attention" else "mla" if t == "full_attention"
                                             else t for t in layer_types]
        self.layer_types = ["full_attention" if m in ("mla", "attention") else "linear_attention"
                            for m in self.moetrain["layer_mixers"]]
        if mlp_layer_types is None:
            k = first_k_dense_replace if first_k_dense_replace is not None else num_hidden_layers
            mlp_layer_types = ["sparse" if (num_experts and l >= k) else "dense" for l in range(num_hidden_layers)]
        self.mlp_layer_types = list(mlp_layer_types)
        kwargs.setdefault("bos_token_id", None)
        kwargs.setdefault("eos_token_id", None)
        kwargs.setdefault("pad_token_id", None)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings
        self.rope_theta = self.mla_rope_theta  # written back as config.json's rope_theta (moetrain reads it)
        self._check()

    # ------------------------------------------------------------------ derived plan

    def _default_layer_types(self):
        lac = self.linear_attn_config
        if "kda_layers" in lac and "full_attn_layers" in lac:
            types = ["linear_attention"] * self.num_hidden_layers
            for l in lac["full_attn_layers"]:
                types[l - 1] = "full_attention"
            return types
        return ["linear_attention"] * self.num_hidden_layers

    @property
    def mixers(self):
        """Per layer: kda, mla, attention, linear_attention, deltanet or gated_deltanet."""
        return list(self.moetrain["layer_mixers"])

    def is_moe_layer(self, l):
        return bool(self.num_experts) and self.mlp_layer_types[l] == "sparse"

    @property
    def kda_num_heads(self):
        return int(self.linear_attn_config.get("num_heads", 4))

    @property
    def kda_head_dim(self):
        return int(self.linear_attn_config.get("head_dim", 16))

    @property
    def kda_num_value_heads(self):
        return int(self.moetrain.get("kda_num_value_heads", self.kda_num_heads))

    @property
    def kda_conv_size(self):
        return int(self.linear_attn_config.get("short_conv_kernel_size", 4))

    @property
    def kda_gate_lower_bound(self):
        """None: the softplus gate (Kimi-Linear); a negative number: K3's lower-bound gate."""
        return self.linear_attn_config.get("gate_lower_bound")

    @property
    def kda_full_rank_output_gate(self):
        return bool(self.linear_attn_config.get("use_full_rank_gate", False))

    @property
    def ffn_kind(self):
        """situ_glu, swiglu or gelu (hidden_act situ, silu, gelu_pytorch_tanh)."""
        kinds = {"situ": "situ_glu", "silu": "swiglu", "gelu_pytorch_tanh": "gelu"}
        return self.moetrain.get("ffn", kinds.get(self.hidden_act, self.hidden_act))

    @property
    def situ_learnable_beta(self):
        return bool(self.moetrain.get("situ_learnable_beta", False))

    @property
    def mla_lora_norm_eps(self):
        return float(self.moetrain.get("mla_lora_norm_eps", 1e-6))

    @property
    def latent_norm_eps(self):
        return float(self.moetrain.get("latent_norm_eps", 1e-5))

    @property
    def attention_num_heads(self):
        return int(self.moetrain.get("attention_num_heads", 4))

    @property
    def moe_capacity_factor(self):
        return float(self.moetrain.get("moe_capacity_factor", 0.0))

    def _check(self):
        """What this implementation does not compute is an error naming the field, never another model."""
        n = self.num_hidden_layers
        mixers = self.mixers
        known = {"kda", "mla", "attention", "linear_attention", "deltanet", "gated_deltanet"}
        if len(mixers) != n or any(m not in known for m in mixers):
            raise ValueError("moetrain_hybrid config: moetrain.layer_mixers / layer_types %r must list %d of %s"
                             % (mixers, n, sorted(known)))
        if len(self.mlp_layer_types) != n or any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
            raise ValueError("moetrain_hybrid config: mlp_layer_types %r must list %d of dense, sparse"
                             % (self.mlp_layer_types, n))
        if self.ffn_kind not in ("situ_glu", "swiglu", "gelu"):
            raise ValueError("moetrain_hybrid config: hidden_act %r: expected situ, silu or gelu_pytorch_tanh"
                             % self.hidden_act)
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("moetrain_hybrid config: num_key_value_heads %s != num_attention_heads %s; MLA has one "
                             "latent for all heads" % (self.num_key_value_heads, self.num_attention_heads))
        if self.attention_bias:
            raise ValueError("moetrain_hybrid config: attention_bias true; moetrain's layers have no biases")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError("moetrain_hybrid config: moe_router_activation_func %r: expected sigmoid or softmax"
                             % self.moe_router_activation_func)
        if self.kda_mode not in ("chunked", "recurrent"):
            raise ValueError("moetrain_hybrid config: kda_mode %r: expected chunked or recurrent" % self.kda_mode)


__all__ = ["MoetrainHybridConfig"]
