// What the model tests of tests/nn share: a tiny GPT-2 and random token ids.
#pragma once

#include <cstdint>

#include "moetrain.h"
#include "nn/gpt2.h"

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

// [B, T] i32 ids in [0, vocab), from their own seed.
inline Tensor random_ids(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  return randint({B, T}, vocab, DType::i32, gen);
}

}  // namespace moetrain::testing
