// Synthetic seed tasks: every row is checked against an interpreter of its own
// input tokens (bindings in order, a switch token clears them), so the expected
// answers do not come from the generator. Plus determinism and bad options.
#include <catch2/catch.hpp>

#include <map>
#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "data/synthetic.h"

using namespace moetrain;
using namespace moetrain::data;

namespace {

SyntheticOptions options(SyntheticTask task) {
  SyntheticOptions o;
  o.task = task;
  o.num_keys = 20;
  o.num_values = 7;
  o.num_pairs = 8;
  o.num_queries = 4;
  o.num_rebinds = task == SyntheticTask::repeated_key ? 4 : 3;
  return o;
}

std::vector<int32_t> row_of(const Tensor& t, int64_t b) {
  const int64_t T = t.size(1);
  const int32_t* p = t.data<int32_t>() + b * T;
  return {p, p + T};
}

bool is_key(const SyntheticOptions& o, int32_t tok) { return tok >= 2 && tok < 2 + o.num_keys; }
bool is_value(const SyntheticOptions& o, int32_t tok) { return tok >= 2 + o.num_keys && tok < o.vocab_size(); }

// Replays row b: pairs bind, the switch token clears the bindings, and every
// position with a target must be a key whose answer is its current binding
// (kUnknownToken if it has none since the switch); stale = the binding it had
// before (overwritten, or from before the switch).
void check_row(const SyntheticOptions& o, const SyntheticBatch& batch, int64_t b) {
  const std::vector<int32_t> in = row_of(batch.inputs, b), tg = row_of(batch.targets, b),
                             st = row_of(batch.stale, b);
  const int64_t T = o.seq_len(), P = o.num_pairs, Q = o.num_queries;
  const bool sw = o.task == SyntheticTask::context_switch;
  const int64_t pair_tokens = sw ? 4 * P + 1 : 2 * P;
  std::map<int32_t, int32_t> now, before;  // key -> value token
  std::map<int32_t, int> times_bound;
  int64_t t = 0;
  for (; t < pair_tokens; t += 2) {
    if (sw && t == 2 * P) {
      REQUIRE(in[t] == kSwitchToken);
      before = now;
      now.clear();
      t -= 1;
      continue;
    }
    REQUIRE(is_key(o, in[t]));
    REQUIRE(is_value(o, in[t + 1]));
    CHECK(tg[t] == kIgnoreIndex);
    CHECK(tg[t + 1] == kIgnoreIndex);
    if (now.count(in[t])) {
      CHECK(in[t + 1] != now[in[t]]);  // a rebinding changes the value
      before[in[t]] = now[in[t]];
    }
    if (before.count(in[t]) && sw) CHECK(in[t + 1] != before[in[t]]);
    now[in[t]] = in[t + 1];
    times_bound[in[t]] += 1;
  }
  REQUIRE(t == pair_tokens);
  std::set<int32_t> asked;
  int64_t unknown = 0;
  for (int64_t i = 0; i < Q; ++i, t += 2) {
    REQUIRE(is_key(o, in[t]));
    CHECK(asked.insert(in[t]).second);  // distinct queries
    const int32_t want = now.count(in[t]) ? now[in[t]] : kUnknownToken;
    CHECK(tg[t] == want);
    CHECK(st[t] == (before.count(in[t]) && before[in[t]] != want ? before[in[t]] : kIgnoreIndex));
    if (t + 1 < T) {
      CHECK(in[t + 1] == want);  // the answer follows its query
      CHECK(tg[t + 1] == kIgnoreIndex);
    }
    unknown += want == kUnknownToken;
    if (o.task == SyntheticTask::repeated_key) CHECK(times_bound[in[t]] == 2);
  }
  REQUIRE(t == T + 1);
  for (int64_t i = 0; i < T; ++i)
    if (tg[i] == kIgnoreIndex) CHECK(st[i] == kIgnoreIndex);
  switch (o.task) {
    case SyntheticTask::assoc_recall: CHECK(now.size() == static_cast<size_t>(P)); break;
    case SyntheticTask::repeated_key: CHECK(now.size() == static_cast<size_t>(P - o.num_rebinds)); break;
    case SyntheticTask::context_switch: {
      CHECK(now.size() == static_cast<size_t>(P));
      int64_t reused = 0;
      for (const auto& [key, value] : now) reused += before.count(key);
      CHECK(reused == o.num_rebinds);
      CHECK(unknown == Q / 2);
      break;
    }
  }
  if (o.task != SyntheticTask::context_switch) CHECK(unknown == 0);
}

}  // namespace

TEST_CASE("synthetic: every task's rows replay to their targets", "[data][synthetic]") {
  for (SyntheticTask task : {SyntheticTask::assoc_recall, SyntheticTask::repeated_key, SyntheticTask::context_switch}) {
    DYNAMIC_SECTION(synthetic_task_name(task)) {
      const SyntheticOptions o = options(task);
      Generator gen(3);
      SyntheticBatch batch = synthetic_batch(o, 64, gen);
      REQUIRE(batch.inputs.shape() == Shape{64, o.seq_len()});
      REQUIRE(batch.targets.shape() == batch.inputs.shape());
      REQUIRE(batch.stale.shape() == batch.inputs.shape());
      REQUIRE(batch.inputs.dtype() == DType::i32);
      REQUIRE(batch.targets.dtype() == DType::i32);
      for (int64_t b = 0; b < 64; ++b) check_row(o, batch, b);
      CHECK(gen.offset() == 64 * kCountersPerRow);
    }
  }
}

TEST_CASE("synthetic: layouts and lengths", "[data][synthetic]") {
  SyntheticOptions o = options(SyntheticTask::assoc_recall);
  CHECK(o.vocab_size() == 2 + 20 + 7);
  CHECK(o.key_token(0) == 2);
  CHECK(o.value_token(6) == 28);
  CHECK(o.seq_len() == 2 * 8 + 2 * 4 - 1);
  o.task = SyntheticTask::context_switch;
  CHECK(o.seq_len() == 4 * 8 + 1 + 2 * 4 - 1);
  // Keys and values are spread: over many rows every key and value token occurs.
  for (SyntheticTask task : {SyntheticTask::assoc_recall, SyntheticTask::repeated_key, SyntheticTask::context_switch}) {
    o = options(task);
    Generator gen(9);
    SyntheticBatch batch = synthetic_batch(o, 200, gen);
    std::set<int32_t> seen;
    for (double v : batch.inputs.to_vector()) seen.insert(static_cast<int32_t>(v));
    // context_switch adds the switch token and kUnknownToken (an answer, so also an input).
    const int64_t specials = task == SyntheticTask::context_switch ? 2 : 0;
    CHECK(seen.size() == static_cast<size_t>(o.num_keys + o.num_values + specials));
  }
}

TEST_CASE("synthetic: rows depend on (seed, row index) only", "[data][synthetic]") {
  const SyntheticOptions o = options(SyntheticTask::context_switch);
  Generator a(5), b(5), c(6);
  SyntheticBatch whole = synthetic_batch(o, 8, a);
  SyntheticBatch first = synthetic_batch(o, 3, b), rest = synthetic_batch(o, 5, b);
  std::vector<double> w = whole.inputs.to_vector(), f = first.inputs.to_vector(), r = rest.inputs.to_vector();
  f.insert(f.end(), r.begin(), r.end());
  CHECK(w == f);
  std::vector<double> wt = whole.targets.to_vector(), ft = first.targets.to_vector(), rt = rest.targets.to_vector();
  ft.insert(ft.end(), rt.begin(), rt.end());
  CHECK(wt == ft);
  CHECK(synthetic_batch(o, 8, c).inputs.to_vector() != w);
  CHECK(synthetic_batch(o, 8, a).inputs.to_vector() != w);  // the stream goes on
}

TEST_CASE("synthetic: task names and impossible layouts", "[data][synthetic]") {
  for (SyntheticTask task : {SyntheticTask::assoc_recall, SyntheticTask::repeated_key, SyntheticTask::context_switch})
    CHECK(parse_synthetic_task(synthetic_task_name(task)) == task);
  CHECK_THROWS_WITH(parse_synthetic_task("copy"), Catch::Contains("unknown synthetic task 'copy'") &&
                                                      Catch::Contains("assoc_recall, repeated_key, context_switch"));
  Generator gen(1);
  SyntheticOptions o = options(SyntheticTask::assoc_recall);
  o.num_pairs = 21;
  CHECK_THROWS_WITH(synthetic_batch(o, 1, gen), Catch::Contains("num_pairs = 21") && Catch::Contains("num_keys = 20"));
  o = options(SyntheticTask::assoc_recall);
  o.num_queries = 9;
  CHECK_THROWS_WITH(o.validate(), Catch::Contains("num_queries = 9 exceeds num_pairs = 8"));
  o = options(SyntheticTask::repeated_key);
  o.num_queries = 5;
  CHECK_THROWS_WITH(o.validate(), Catch::Contains("num_queries = 5 exceeds num_rebinds = 4"));
  o.num_rebinds = 5;
  CHECK_THROWS_WITH(o.validate(), Catch::Contains("num_rebinds = 5 must be in [1, num_pairs / 2 = 4]"));
  o = options(SyntheticTask::context_switch);
  o.num_keys = 12;
  CHECK_THROWS_WITH(o.validate(), Catch::Contains("2 num_pairs - num_rebinds = 13") && Catch::Contains("num_keys = 12"));
  o = options(SyntheticTask::context_switch);
  o.num_rebinds = 7;
  CHECK_THROWS_WITH(o.validate(), Catch::Contains("pre-switch-only keys (have num_pairs - num_rebinds = 1)"));
  o.num_values = 1;
  CHECK_THROWS_WITH(o.validate(), Catch::Contains("num_values = 1 must be >= 2"));
  CHECK_THROWS_WITH(synthetic_batch(options(SyntheticTask::assoc_recall), 0, gen),
                    Catch::Contains("batch_size = 0"));
}

TEST_CASE("synthetic: the training stream is Generator(seed)'s batches in order and resumes exactly",
          "[data][synthetic]") {
  const SyntheticOptions o = options(SyntheticTask::repeated_key);
  SyntheticStream stream(o, 3, 42);
  Generator gen(42);
  std::vector<SyntheticBatch> taken;
  for (int i = 0; i < 3; ++i) {
    taken.push_back(stream.next());
    SyntheticBatch direct = synthetic_batch(o, 3, gen);
    CHECK(row_of(taken.back().inputs, 2) == row_of(direct.inputs, 2));
    CHECK(row_of(taken.back().targets, 0) == row_of(direct.targets, 0));
  }
  CHECK(stream.state() == LoaderState{0, 3});
  SyntheticStream resumed(o, 3, 42);
  resumed.set_state({0, 2});
  SyntheticBatch third = resumed.next();
  for (int64_t b = 0; b < 3; ++b) CHECK(row_of(third.inputs, b) == row_of(taken[2].inputs, b));
  CHECK(resumed.state() == LoaderState{0, 3});
  CHECK_THROWS_WITH(resumed.set_state({1, 0}), Catch::Contains("epoch 1"));
  SyntheticOptions bad = o;
  bad.num_rebinds = 9;  // more than the 8 pairs
  CHECK_THROWS_AS(SyntheticStream(bad, 3, 1), Error);
}
