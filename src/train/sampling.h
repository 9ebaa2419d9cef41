// Autoregressive sampling from a model with its decoding caches: the prompt is run
// once (prefill), then one token per step; the prefix is never recomputed.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include <utility>

#include "nn/language_model.h"

namespace moetrain {

struct SamplingOptions {
  int64_t max_new_tokens = 128;
  double temperature = 0.8;  // 0: greedy (argmax, lowest id among ties): bit-reproducible
  int64_t top_k = 0;         // 0: the whole vocabulary
  uint64_t seed = 1337;
  int64_t stop_token = -1;   // stop after emitting this id (e.g. GPT-2's <|endoftext|>); -1: never
};

// Picks the next id from logits [V] (f32 or f64): temperature, top-k, then an
// inverse-CDF draw with Philox counter `counter` of a Generator(seed).
int64_t sample_token(const Tensor& logits, const SamplingOptions& options, uint64_t counter);

// Returns only the new ids. Stops early when the model has seen n_ctx positions
// (the token predicted from a full context is the last one returned), so at most
// max_new_tokens_in_context(n_ctx, prompt tokens) ids; stats->stopped_at_context
// then says so. No model here has a sliding window.
struct GenerateStats {
  // (tokens in the cache, bytes of all decoding caches) after each generated token:
  // constant for KDA states, linear in the tokens for KV / latent caches.
  std::vector<std::pair<int64_t, int64_t>> cache_bytes;
  // True when generation ended because the context was full, before max_new_tokens
  // ids and without the stop token.
  bool stopped_at_context = false;
};

// The most ids generate() can return after a prompt of `prompt_tokens` tokens with a
// context of n_ctx positions: n_ctx - prompt_tokens + 1 (the last one is predicted
// from the full context); 0 when the prompt does not fit (generate() refuses it).
int64_t max_new_tokens_in_context(int64_t n_ctx, int64_t prompt_tokens);

std::vector<int32_t> generate(LanguageModel& model, const std::vector<int32_t>& prompt, const SamplingOptions& options,
                              GenerateStats* stats = nullptr);

}  // namespace moetrain
