// What the model tests of tests/nn share: a tiny GPT-2, a tiny hybrid and random token ids.
#pragma once

#include <cstdint>
#include <vector>

#include "moetrain.h"
#include "nn/gpt2.h"
#include "nn/hybrid.h"

namespace moetrain::testing {

// GPT-2 with 2 layers, 2 heads, width 8, 16 positions and 37 tokens (padded to a
// multiple of pad_multiple rows).
inline Gpt2Config tiny_gpt2(DType dtype = DType::f64, int64_t pad_multiple = 1) {
  Gpt2Config c;
  c.vocab_size = 37;
  c.vocab_pad_multiple = pad_multiple;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 8;
  c.n_ctx = 16;
  c.d_ff = 32;
  c.dtype = dtype;
  return c;
}

// Every feature at once: KDA (lower-bound gate, GVA), KDA (softplus gate, low-rank
// output gate), MLA with query LoRA and output gate, plain attention, SiTU-GLU with
// a learnable beta, AttnRes blocks of 2 layers (a partial last block); layers 2-4
// are latent MoE layers (4 experts, top 2, one shared expert); 23 tokens (padded to
// a multiple of pad_multiple rows).
inline HybridConfig tiny_hybrid(DType dtype = DType::f64, bool attn_res = true, bool chunked = true,
                                int64_t pad_multiple = 1) {
  HybridConfig c;
  c.vocab_size = 23;
  c.vocab_pad_multiple = pad_multiple;
  c.d_model = 12;
  c.n_ctx = 64;
  c.mixers = {MixerKind::kda, MixerKind::mla, MixerKind::kda, MixerKind::attention, MixerKind::kda};
  c.attention_n_head = 3;
  c.kda.n_head = 2;
  c.kda.n_value_head = 4;
  c.kda.head_dim = 3;
  c.kda.chunked = chunked;
  c.kda.chunk_size = 4;
  c.mla.n_head = 2;
  c.mla.q_lora_rank = 5;
  c.mla.kv_lora_rank = 4;
  c.mla.qk_nope_head_dim = 3;
  c.mla.qk_rope_head_dim = 2;
  c.mla.v_head_dim = 3;
  c.ffn.d_ff = 10;
  c.ffn.situ_learnable_beta = true;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_d_ff = 3;
  c.moe.latent_dim = 4;
  c.moe.num_shared_experts = 1;
  c.moe.first_dense_layers = 2;
  c.attn_res = attn_res;
  c.attn_res_block_size = 2;
  c.embed_init_std = 1.0;
  c.init_std = 0.3;  // large enough that every path moves the loss
  c.dtype = dtype;
  return c;
}

// Rows [lo, hi) of a 2-D tensor (any device) as doubles.
inline std::vector<double> rows_of(const Tensor& t, int64_t lo, int64_t hi) {
  return slice(t.detach().to(kCpu), 0, lo, hi).contiguous().to_vector();
}

// [B, T] i32 ids in [0, vocab), from their own seed.
inline Tensor random_ids(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  return randint({B, T}, vocab, DType::i32, gen);
}

}  // namespace moetrain::testing
