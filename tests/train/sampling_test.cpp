#include <catch2/catch.hpp>

#include <cmath>

#include "moetrain.h"
#include "nn/gpt2.h"
#include "train/sampling.h"

using namespace moetrain;

namespace {
Gpt2 tiny_model() {
  Gpt2Config c;
  c.vocab_size = 29;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 16;
  c.n_ctx = 32;
  c.d_ff = 64;
  return Gpt2(c, 9);
}
}  // namespace

TEST_CASE("sampling: greedy decoding with the cache equals argmax of full forwards", "[train][sampling]") {
  Gpt2 model = tiny_model();
  std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  SamplingOptions greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = 10;
  std::vector<int32_t> out = generate(model, prompt, greedy);
  REQUIRE(out.size() == 10);
  std::vector<int32_t> seq = prompt;
  NoGradGuard guard;
  for (int32_t token : out) {
    Tensor logits = model.forward(from_span<int32_t>(seq, {1, static_cast<int64_t>(seq.size())}), false);
    std::vector<double> all = logits.to_vector(), last(all.end() - 29, all.end());
    CHECK(token == std::max_element(last.begin(), last.end()) - last.begin());
    seq.push_back(token);
  }
  CHECK(generate(model, prompt, greedy) == out);  // bit-reproducible
}

TEST_CASE("sampling: seeded, top-k restricted, frequencies follow the softmax", "[train][sampling]") {
  Tensor logits = from_vector({0.0, std::log(2.0), std::log(3.0), -50.0}, {4}, DType::f64);
  SamplingOptions o;
  o.temperature = 1.0;
  o.top_k = 3;
  o.seed = 5;
  std::vector<int> counts(4, 0);
  for (uint64_t c = 0; c < 60000; ++c) counts[static_cast<size_t>(sample_token(logits, o, c))]++;
  CHECK(counts[3] == 0);
  CHECK(counts[0] / 60000.0 == Approx(1.0 / 6).margin(0.01));
  CHECK(counts[2] / 60000.0 == Approx(3.0 / 6).margin(0.01));
  CHECK(sample_token(logits, o, 17) == sample_token(logits, o, 17));
  o.top_k = 1;
  for (uint64_t c = 0; c < 100; ++c) CHECK(sample_token(logits, o, c) == 2);
}

TEST_CASE("sampling: generation stops at the context length and at the stop token", "[train][sampling]") {
  Gpt2 model = tiny_model();
  SamplingOptions o;
  o.max_new_tokens = 100;
  // The last forward sees n_ctx = 32 positions and predicts one more token: 3 + 30 = 33.
  CHECK(generate(model, {1, 2, 3}, o).size() == 30);
  o.temperature = 0;
  std::vector<int32_t> greedy = generate(model, {1, 2, 3}, o);
  o.stop_token = greedy[2];
  std::vector<int32_t> stopped = generate(model, {1, 2, 3}, o);
  CHECK(stopped.back() == greedy[2]);
  CHECK(stopped.size() <= 3);
  CHECK_THROWS_WITH(generate(model, {}, o), Catch::Contains("prompt is empty"));
}

TEST_CASE("sampling: GenerateStats says when the context, not max_new_tokens, ended the text", "[train][sampling]") {
  Gpt2 model = tiny_model();  // n_ctx 32
  // The room after a prompt: 32 - 3 + 1 = 30 with 3 prompt tokens; 1 prompt token: 32.
  CHECK(max_new_tokens_in_context(32, 3) == 30);
  CHECK(max_new_tokens_in_context(32, 1) == 32);
  CHECK(max_new_tokens_in_context(32, 31) == 2);
  CHECK(max_new_tokens_in_context(32, 32) == 0);  // generate() refuses a prompt that fills the context
  CHECK(max_new_tokens_in_context(32, 0) == 0);
  SamplingOptions o;
  o.temperature = 0;
  o.max_new_tokens = 31;
  GenerateStats cut;
  CHECK(generate(model, {1, 2, 3}, o, &cut).size() == 30);
  CHECK(cut.stopped_at_context);
  o.max_new_tokens = 30;  // exactly what fits: ended by max_new_tokens
  GenerateStats fits;
  CHECK(generate(model, {1, 2, 3}, o, &fits).size() == 30);
  CHECK_FALSE(fits.stopped_at_context);
  o.max_new_tokens = 5;
  GenerateStats short_run;
  CHECK(generate(model, {1, 2, 3}, o, &short_run).size() == 5);
  CHECK_FALSE(short_run.stopped_at_context);
}
