// Synthetic seed tasks (layouts in synthetic.h). Each row draws from its own
// block of Philox counters, one counter per draw.
#include "data/synthetic.h"

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

namespace moetrain::data {

SyntheticTask parse_synthetic_task(const std::string& name) {
  if (name == "assoc_recall") return SyntheticTask::assoc_recall;
  if (name == "repeated_key") return SyntheticTask::repeated_key;
  if (name == "context_switch") return SyntheticTask::context_switch;
  MT_THROW("unknown synthetic task '{}' (assoc_recall, repeated_key, context_switch)", name);
}

const char* synthetic_task_name(SyntheticTask task) {
  switch (task) {
    case SyntheticTask::assoc_recall: return "assoc_recall";
    case SyntheticTask::repeated_key: return "repeated_key";
    case SyntheticTask::context_switch: return "context_switch";
  }
  return "?";
}

int64_t SyntheticOptions::seq_len() const {
  const int64_t pairs = task == SyntheticTask::context_switch ? 4 * num_pairs + 1 : 2 * num_pairs;
  return pairs + 2 * num_queries - 1;
}

void SyntheticOptions::validate() const {
  const char* name = synthetic_task_name(task);
  MT_CHECK(num_pairs >= 1 && num_queries >= 1, "synthetic {}: num_pairs = {} and num_queries = {} must be >= 1", name,
           num_pairs, num_queries);
  MT_CHECK(num_values >= 2, "synthetic {}: num_values = {} must be >= 2", name, num_values);
  switch (task) {
    case SyntheticTask::assoc_recall:
      MT_CHECK(num_pairs <= num_keys, "synthetic assoc_recall: num_pairs = {} distinct keys exceed num_keys = {}",
               num_pairs, num_keys);
      MT_CHECK(num_queries <= num_pairs, "synthetic assoc_recall: num_queries = {} exceeds num_pairs = {}",
               num_queries, num_pairs);
      break;
    case SyntheticTask::repeated_key:
      MT_CHECK(num_rebinds >= 1 && 2 * num_rebinds <= num_pairs,
               "synthetic repeated_key: num_rebinds = {} must be in [1, num_pairs / 2 = {}]", num_rebinds,
               num_pairs / 2);
      MT_CHECK(num_pairs - num_rebinds <= num_keys,
               "synthetic repeated_key: num_pairs - num_rebinds = {} distinct keys exceed num_keys = {}",
               num_pairs - num_rebinds, num_keys);
      MT_CHECK(num_queries <= num_rebinds,
               "synthetic repeated_key: num_queries = {} exceeds num_rebinds = {} (queries ask rebound keys)",
               num_queries, num_rebinds);
      break;
    case SyntheticTask::context_switch:
      MT_CHECK(num_rebinds >= 0 && num_rebinds <= num_pairs,
               "synthetic context_switch: num_rebinds = {} must be in [0, num_pairs = {}]", num_rebinds, num_pairs);
      MT_CHECK(2 * num_pairs - num_rebinds <= num_keys,
               "synthetic context_switch: 2 num_pairs - num_rebinds = {} distinct keys exceed num_keys = {}",
               2 * num_pairs - num_rebinds, num_keys);
      MT_CHECK(num_queries - num_queries / 2 <= num_pairs && num_queries / 2 <= num_pairs - num_rebinds,
               "synthetic context_switch: num_queries = {} needs {} post-switch keys (have num_pairs = {}) and {} "
               "pre-switch-only keys (have num_pairs - num_rebinds = {})",
               num_queries, num_queries - num_queries / 2, num_pairs, num_queries / 2, num_pairs - num_rebinds);
      break;
  }
}

namespace {

// Uniform integers from consecutive Philox counters of one row's block.
class Draws {
 public:
  Draws(const Generator& gen, uint64_t first) : gen_(gen), next_(first), end_(first + kCountersPerRow) {}

  int64_t below(int64_t n) {  // uniform in [0, n), multiply-shift on 64 bits
    MT_ASSERT(next_ < end_, "synthetic: a row used more than {} counters", kCountersPerRow);
    const std::array<uint32_t, 4> r = gen_.bits(next_++);
    const uint64_t x = (static_cast<uint64_t>(r[0]) << 32) | r[1];
    return static_cast<int64_t>((static_cast<unsigned __int128>(x) * static_cast<uint64_t>(n)) >> 64);
  }
  template <class T> void shuffle(std::vector<T>& v) {  // Fisher-Yates
    for (size_t i = v.size(); i-- > 1;) std::swap(v[i], v[static_cast<size_t>(below(static_cast<int64_t>(i) + 1))]);
  }
  // k distinct elements of [0, n) in random order (partial Fisher-Yates).
  std::vector<int64_t> distinct(int64_t n, int64_t k) {
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), int64_t{0});
    for (int64_t i = 0; i < k; ++i) std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(i + below(n - i))]);
    all.resize(static_cast<size_t>(k));
    return all;
  }
  // A value index in [0, n) other than `other`.
  int64_t other_than(int64_t other, int64_t n) {
    const int64_t x = below(n - 1);
    return x >= other ? x + 1 : x;
  }

 private:
  const Generator& gen_;
  uint64_t next_, end_;
};

struct Query {
  int64_t key;
  int32_t answer, stale;
};

// One row: the token sequence (seq_len() + 1 tokens) and, per token, the
// target and stale entries of its position: the answer (and stale value) after
// a query key, kIgnoreIndex elsewhere.
struct Row {
  std::vector<int32_t> tokens, target, stale;
};

Row draw_row(const SyntheticOptions& o, Draws& d) {
  const int64_t P = o.num_pairs, Q = o.num_queries, R = o.num_rebinds;
  Row row;
  auto pair = [&](int64_t key, int64_t value) {
    row.tokens.push_back(o.key_token(key));
    row.tokens.push_back(o.value_token(value));
  };
  std::vector<Query> queries;
  switch (o.task) {
    case SyntheticTask::assoc_recall: {
      std::vector<int64_t> keys = d.distinct(o.num_keys, P), values(static_cast<size_t>(P));
      for (int64_t i = 0; i < P; ++i) pair(keys[i], values[i] = d.below(o.num_values));
      for (int64_t i : d.distinct(P, Q)) queries.push_back({keys[i], o.value_token(values[i]), kIgnoreIndex});
      break;
    }
    case SyntheticTask::repeated_key: {
      // Slots: the P - R distinct keys, the first R of them once more; shuffled,
      // so a rebound key's two slots land anywhere (its first slot binds first).
      std::vector<int64_t> keys = d.distinct(o.num_keys, P - R), slots = keys;
      slots.insert(slots.end(), keys.begin(), keys.begin() + R);
      d.shuffle(slots);
      std::vector<int64_t> first(static_cast<size_t>(o.num_keys), -1), last(first);
      for (int64_t key : slots) {
        const int64_t value = first[key] < 0 ? d.below(o.num_values) : d.other_than(first[key], o.num_values);
        (first[key] < 0 ? first[key] : last[key]) = value;
        pair(key, value);
      }
      for (int64_t i : d.distinct(R, Q))
        queries.push_back({keys[i], o.value_token(last[keys[i]]), o.value_token(first[keys[i]])});
      break;
    }
    case SyntheticTask::context_switch: {
      // keys[0, P): pre-switch; keys[P, 2P - R): new after the switch; `reused`:
      // which pre-switch keys are bound again.
      std::vector<int64_t> keys = d.distinct(o.num_keys, 2 * P - R), pre(static_cast<size_t>(P));
      for (int64_t i = 0; i < P; ++i) pair(keys[i], pre[i] = d.below(o.num_values));
      row.tokens.push_back(kSwitchToken);
      std::vector<bool> is_reused(static_cast<size_t>(P), false);
      std::vector<int64_t> post_slots;  // indices into keys
      for (int64_t i : d.distinct(P, R)) {
        is_reused[i] = true;
        post_slots.push_back(i);
      }
      for (int64_t i = P; i < 2 * P - R; ++i) post_slots.push_back(i);
      d.shuffle(post_slots);
      std::vector<Query> post_queries, stale_queries;
      for (int64_t i : post_slots) {
        const int64_t value = i < P ? d.other_than(pre[i], o.num_values) : d.below(o.num_values);
        pair(keys[i], value);
        post_queries.push_back({keys[i], o.value_token(value), i < P ? o.value_token(pre[i]) : kIgnoreIndex});
      }
      std::vector<int64_t> pre_only;
      for (int64_t i = 0; i < P; ++i)
        if (!is_reused[i]) pre_only.push_back(i);
      for (int64_t j : d.distinct(P, Q - Q / 2)) queries.push_back(post_queries[j]);
      for (int64_t j : d.distinct(P - R, Q / 2)) {
        const int64_t i = pre_only[j];
        queries.push_back({keys[i], kUnknownToken, o.value_token(pre[i])});
      }
      d.shuffle(queries);
      break;
    }
  }
  row.target.assign(row.tokens.size(), kIgnoreIndex);
  row.stale.assign(row.tokens.size(), kIgnoreIndex);
  for (const Query& q : queries) {
    row.tokens.push_back(o.key_token(q.key));
    row.target.push_back(q.answer);
    row.stale.push_back(q.stale);
    row.tokens.push_back(q.answer);
    row.target.push_back(kIgnoreIndex);
    row.stale.push_back(kIgnoreIndex);
  }
  MT_ASSERT(static_cast<int64_t>(row.tokens.size()) == o.seq_len() + 1, "synthetic: row of {} tokens, expected {}",
            row.tokens.size(), o.seq_len() + 1);
  return row;
}

}  // namespace

SyntheticBatch synthetic_batch(const SyntheticOptions& o, int64_t batch_size, Generator& gen) {
  o.validate();
  MT_CHECK(batch_size >= 1, "synthetic_batch: batch_size = {} must be >= 1", batch_size);
  const int64_t T = o.seq_len();
  const uint64_t first = gen.reserve(static_cast<uint64_t>(batch_size) * kCountersPerRow);
  SyntheticBatch batch;
  batch.inputs = empty({batch_size, T}, DType::i32);
  batch.targets = empty({batch_size, T}, DType::i32);
  batch.stale = empty({batch_size, T}, DType::i32);
  int32_t *in = batch.inputs.data<int32_t>(), *tg = batch.targets.data<int32_t>(), *st = batch.stale.data<int32_t>();
  for (int64_t b = 0; b < batch_size; ++b) {
    Draws draws(gen, first + static_cast<uint64_t>(b) * kCountersPerRow);
    const Row row = draw_row(o, draws);
    // The last token (the final answer) is a target only.
    for (int64_t t = 0; t < T; ++t) {
      in[b * T + t] = row.tokens[t];
      tg[b * T + t] = row.target[t];
      st[b * T + t] = row.stale[t];
    }
  }
  return batch;
}

SyntheticStream::SyntheticStream(const SyntheticOptions& options, int64_t batch_size, uint64_t seed)
    : options_(options), batch_size_(batch_size), gen_(seed) {
  options_.validate();
  MT_CHECK(batch_size >= 1, "synthetic stream: batch_size = {} must be >= 1", batch_size);
}

SyntheticBatch SyntheticStream::next() {
  ++batches_;
  return synthetic_batch(options_, batch_size_, gen_);
}

void SyntheticStream::set_state(const LoaderState& state) {
  MT_CHECK(state.epoch == 0 && state.position >= 0,
           "synthetic stream: cannot resume at epoch {} position {}; expected epoch 0 and a batch count >= 0",
           state.epoch, state.position);
  batches_ = state.position;
  gen_.set_offset(static_cast<uint64_t>(batches_ * batch_size_) * kCountersPerRow);
}

}  // namespace moetrain::data
