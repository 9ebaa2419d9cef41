// Synthetic sequence tasks that probe a token mixer's memory, the "seed tasks"
// of the KDA model: associative recall, repeated-key replacement (the later
// binding wins) and context switch (a marker makes earlier bindings stale).
//
// Vocabulary (vocab_size() tokens): kSwitchToken = 0, kUnknownToken = 1 (the
// answer for a key that has no binding in the current context), then num_keys
// key tokens (key_token(i)), then num_values value tokens (value_token(i)).
//
// A row is a token sequence of seq_len() + 1 tokens; "k v" is a key token
// followed by its value token, "q a" a query key followed by its answer:
//   assoc_recall:   (k v) x P,                      (q a) x Q
//       P distinct keys, values drawn with replacement; queries ask distinct bound keys.
//   repeated_key:   (k v) x P,                      (q a) x Q
//       P - R distinct keys, R of them bound twice (the second binding later, to
//       another value); queries ask distinct rebound keys, answer = the later value.
//   context_switch: (k v) x P, kSwitchToken, (k v) x P, (q a) x Q
//       2P - R distinct keys: after the switch R pre-switch keys are bound anew
//       (to other values) and P - R keys are new. Q - Q/2 queries ask distinct
//       post-switch keys (answer: the post-switch value), Q/2 ask distinct
//       pre-switch-only keys (answer: kUnknownToken). Queries are shuffled.
// (P = num_pairs, Q = num_queries, R = num_rebinds.) As in the data loader,
// inputs = tokens 0..T-1 and targets = tokens 1..T, but every target except
// the answers is kIgnoreIndex, so loss (cross_entropy's ignore_index) and
// accuracy count the answers only: the target at a query key's position is its answer.
//
// Reproducible: row i of the stream of a Generator(seed) is a pure function of
// (seed, i, options); synthetic_batch takes the next batch_size rows (it
// reserves kCountersPerRow Philox counters per row), so batches of 8 then 8
// rows equal one batch of 16.
#pragma once

#include <cstdint>
#include <string>

#include "core/rng.h"
#include "core/tensor.h"
#include "data/loader.h"

namespace moetrain::data {

enum class SyntheticTask { assoc_recall, repeated_key, context_switch };

// "assoc_recall", "repeated_key" or "context_switch"; anything else throws, naming the choices.
SyntheticTask parse_synthetic_task(const std::string& name);
const char* synthetic_task_name(SyntheticTask task);

constexpr int32_t kSwitchToken = 0;
constexpr int32_t kUnknownToken = 1;
constexpr int32_t kIgnoreIndex = -100;
constexpr uint64_t kCountersPerRow = uint64_t{1} << 16;

struct SyntheticOptions {
  SyntheticTask task = SyntheticTask::assoc_recall;
  int64_t num_keys = 64;    // key vocabulary
  int64_t num_values = 64;  // value vocabulary
  int64_t num_pairs = 8;    // P: pairs per row (per context for context_switch)
  int64_t num_queries = 4;  // Q: queries per row, each followed by its answer
  int64_t num_rebinds = 2;  // R: repeated_key, context_switch (unused by assoc_recall)

  int64_t vocab_size() const { return 2 + num_keys + num_values; }
  int32_t key_token(int64_t i) const { return static_cast<int32_t>(2 + i); }
  int32_t value_token(int64_t i) const { return static_cast<int32_t>(2 + num_keys + i); }
  int64_t seq_len() const;  // T
  // Throws moetrain::Error naming the field when the layout above cannot be drawn.
  void validate() const;
};

struct SyntheticBatch : Batch {
  // [B, T] i32: at an answer position whose key had an earlier binding that no
  // longer holds (repeated_key: the overwritten value; context_switch: the
  // pre-switch value), that stale value; kIgnoreIndex elsewhere.
  Tensor stale;
};

// The next batch_size rows of gen's stream (advances gen by batch_size * kCountersPerRow).
SyntheticBatch synthetic_batch(const SyntheticOptions& options, int64_t batch_size, Generator& gen);

// The training data source of `data.synthetic`: batches of batch_size rows from
// the stream of Generator(seed), in order. state() is (epoch 0, batches taken), so a
// checkpoint resumes the stream exactly where it stopped.
class SyntheticStream {
 public:
  SyntheticStream(const SyntheticOptions& options, int64_t batch_size, uint64_t seed);
  SyntheticBatch next();
  LoaderState state() const { return {0, batches_}; }
  void set_state(const LoaderState& state);
  const SyntheticOptions& options() const { return options_; }

 private:
  SyntheticOptions options_;
  int64_t batch_size_;
  Generator gen_;
  int64_t batches_ = 0;
};

}  // namespace moetrain::data
