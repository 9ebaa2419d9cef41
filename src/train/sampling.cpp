#include "train/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/rng.h"
#include "ops/view/view.h"

namespace moetrain {

int64_t sample_token(const Tensor& logits, const SamplingOptions& options, uint64_t counter) {
  std::vector<double> z = logits.to_vector();
  const int64_t V = static_cast<int64_t>(z.size());
  MT_CHECK(V > 0, "sample_token: empty logits");
  const int64_t bad = std::count_if(z.begin(), z.end(), [](double x) { return !std::isfinite(x); });
  if (bad > 0)  // never text sampled from NaN: the weights overflow in use
    throw NumericalError(fmt::format("generate: {} of the model's {} logits for the next token are NaN or infinite: "
                                     "its weights are too large to compute with in {}", bad, V, logits.dtype()));
  if (options.temperature <= 0.0) return std::max_element(z.begin(), z.end()) - z.begin();
  // Candidates: the top-k ids (ties: lower id first), in descending order.
  std::vector<int64_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  int64_t k = options.top_k > 0 ? std::min(options.top_k, V) : V;
  auto better = [&](int64_t a, int64_t b) { return z[a] != z[b] ? z[a] > z[b] : a < b; };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), better);
  double m = z[static_cast<size_t>(ids[0])], total = 0;
  std::vector<double> p(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) total += p[i] = std::exp((z[ids[i]] - m) / options.temperature);
  double u = Generator(options.seed).uniform(counter) * total, acc = 0;
  for (int64_t i = 0; i < k; ++i) {
    acc += p[i];
    if (u < acc) return ids[i];
  }
  return ids[k - 1];
}

int64_t max_new_tokens_in_context(int64_t n_ctx, int64_t prompt_tokens) {
  return prompt_tokens >= 1 && prompt_tokens < n_ctx ? n_ctx - prompt_tokens + 1 : 0;
}

std::vector<int32_t> generate(LanguageModel& model, const std::vector<int32_t>& prompt, const SamplingOptions& options,
                              GenerateStats* stats) {
  MT_CHECK(!prompt.empty(), "generate: the prompt is empty; give at least one token (e.g. a newline)");
  const int64_t n_ctx = model.max_positions();
  MT_CHECK(static_cast<int64_t>(prompt.size()) < n_ctx, "generate: the prompt has {} tokens but the context is {}",
           prompt.size(), n_ctx);
  std::unique_ptr<DecodeCache> cache = model.new_cache();
  Tensor ids = from_span<int32_t>(prompt, {1, static_cast<int64_t>(prompt.size())});
  std::vector<int32_t> out;
  for (int64_t step = 0; step < options.max_new_tokens && cache->length() < n_ctx; ++step) {
    Tensor logits = model.forward_cached(ids, *cache);  // [1, T, V]
    Tensor last = reshape(slice(logits, 1, -1, logits.size(1)), {logits.size(2)});
    int32_t next = static_cast<int32_t>(sample_token(last, options, static_cast<uint64_t>(step)));
    out.push_back(next);
    if (next == options.stop_token) break;
    ids = from_span<int32_t>(std::span<const int32_t>(&next, 1), {1, 1});
    if (stats) stats->cache_bytes.emplace_back(cache->length(), cache->bytes());
  }
  if (stats)
    stats->stopped_at_context = static_cast<int64_t>(out.size()) < options.max_new_tokens &&
                                (out.empty() || out.back() != options.stop_token) && cache->length() >= n_ctx;
  return out;
}

}  // namespace moetrain
