// DataLoader (conventions in loader.h). The shuffled order of epoch e is
// Fisher-Yates over the window indices with, for step i (swap position i with
// a j in [0, i]), j = floor(x * (i + 1) / 2^64), x the first 64 bits of
// Philox(seed, counter e * num_windows + i): each epoch draws fresh counters.
#include "data/loader.h"

#include <glob.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "core/error.h"
#include "core/rng.h"

namespace moetrain::data {

std::vector<std::string> expand_shard_pattern(const std::string& pattern) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (rc == GLOB_NOMATCH) MT_THROW("no files match the shard pattern \"{}\"; run `moetrain prepare` first?", pattern);
  MT_CHECK(rc == 0, "cannot expand the shard pattern \"{}\" (glob error {})", pattern, rc);
  std::sort(files.begin(), files.end());  // byte order, whatever the locale
  return files;
}

DataLoader::DataLoader(const std::string& pattern, const DataLoaderOptions& options) : options_(options) {
  files_ = expand_shard_pattern(pattern);
  open(fmt::format("\"{}\"", pattern));
}

DataLoader::DataLoader(std::vector<std::string> files, const DataLoaderOptions& options)
    : options_(options), files_(std::move(files)) {
  MT_CHECK(!files_.empty(), "data loader: no shard files given");
  open(files_.size() == 1 ? files_[0] : fmt::format("{} and {} more shard(s)", files_[0], files_.size() - 1));
}

void DataLoader::open(const std::string& source) {
  const DataLoaderOptions& o = options_;
  MT_CHECK(o.batch_size >= 1 && o.seq_len >= 1, "data loader: batch_size = {} and seq_len = {} must be >= 1",
           o.batch_size, o.seq_len);
  // Batches hold int32 ids; a shard's ids are uint16 or uint32 (data/shard.h).
  MT_CHECK(o.vocab_size >= 1 && o.vocab_size <= std::numeric_limits<int32_t>::max(),
           "data loader: vocab_size = {} must be in [1, {}] (batches hold int32 ids)", o.vocab_size,
           std::numeric_limits<int32_t>::max());
  MT_CHECK(o.world_size >= 1 && o.rank >= 0 && o.rank < o.world_size,
           "data loader: rank {} is outside [0, world_size = {})", o.rank, o.world_size);

  first_window_.assign(1, 0);
  for (const std::string& file : files_) {
    TokenShard shard(file);
    const int64_t n = shard.num_tokens();
    // A tokenizer of more than 65536 ids writes uint32 shards: a uint16 one came from another tokenizer. (A
    // uint32 shard for a small vocabulary is only wasteful; ids beyond vocab_size are refused below.)
    MT_CHECK(shard.width() == TokenWidth::u32 || o.tokenizer_vocab_size <= kShardMaxId16 + 1,
             "{}: a uint16 token shard (magic {} at offset 0), but the tokenizer has {} ids, more than uint16 holds: "
             "the shard was made with another tokenizer; run `moetrain prepare` with this one (it writes uint32 "
             "shards)",
             file, kShardMagic, o.tokenizer_vocab_size);
    // Every id inside the vocabulary, read in chunks of 1 Mi tokens: the largest id
    // first (a vectorisable pass), the offending offset only on failure.
    std::vector<uint32_t> chunk;
    for (int64_t first = 0; first < n; first += int64_t{1} << 20) {
      chunk.resize(static_cast<size_t>(std::min<int64_t>(int64_t{1} << 20, n - first)));
      shard.read(first, static_cast<int64_t>(chunk.size()), chunk.data());
      uint32_t max_id = 0;
      for (uint32_t t : chunk) max_id = std::max(max_id, t);
      if (max_id >= o.vocab_size) {
        const auto it = std::find_if(chunk.begin(), chunk.end(), [&](uint32_t t) { return t >= o.vocab_size; });
        const int64_t offset = first + (it - chunk.begin());
        MT_THROW("{}: token id {} at token offset {} (byte offset {}) is outside the vocabulary [0, {}); was the "
                 "shard made with another tokenizer?",
                 file, *it, offset, kShardHeaderBytes + shard.bytes_per_token() * offset, o.vocab_size);
      }
    }
    const int64_t windows = n >= o.seq_len + 1 ? (n - 1) / o.seq_len : 0;
    num_tokens_ += n;
    first_window_.push_back(first_window_.back() + windows);
    shards_.push_back(std::move(shard));
  }
  num_windows_ = first_window_.back();
  MT_CHECK(num_windows_ <= int64_t{0xFFFFFFFF}, "data loader: {}: {} windows exceed 2^32 - 1; raise seq_len", source,
           num_windows_);
  const int64_t per_rank = num_windows_ / o.world_size;
  MT_CHECK(per_rank >= o.batch_size,
           "data loader: {}: {} tokens in {} shard(s) make {} windows of seq_len + 1 = {} tokens, {} per rank for "
           "{} rank(s), fewer than batch_size = {}; lower batch_size or seq_len, or prepare more tokens",
           source, num_tokens_, shards_.size(), num_windows_, o.seq_len + 1, per_rank, o.world_size, o.batch_size);
}

const std::vector<uint32_t>& DataLoader::permutation(uint64_t epoch) const {
  if (!perm_.empty() && perm_epoch_ == epoch) return perm_;
  const auto n = static_cast<uint64_t>(num_windows_);
  perm_.resize(n);
  std::iota(perm_.begin(), perm_.end(), uint32_t{0});
  if (options_.order == LoaderOrder::shuffled) {
    Generator gen(options_.seed);
    const uint64_t base = epoch * n;
    for (uint64_t i = n; i-- > 1;) {
      const std::array<uint32_t, 4> r = gen.bits(base + i);
      const uint64_t x = (static_cast<uint64_t>(r[0]) << 32) | r[1];
      const auto j = static_cast<uint64_t>((static_cast<unsigned __int128>(x) * (i + 1)) >> 64);
      std::swap(perm_[i], perm_[j]);
    }
  }
  perm_epoch_ = epoch;
  return perm_;
}

int64_t DataLoader::window_at(uint64_t epoch, int64_t k) const {
  MT_CHECK(k >= 0 && k < num_windows_per_rank(), "data loader: window {} of an epoch is outside [0, {})", k,
           num_windows_per_rank());
  const int64_t i = k * options_.world_size + options_.rank;
  if (options_.order == LoaderOrder::sequential) return i;
  return permutation(epoch)[static_cast<size_t>(i)];
}

void DataLoader::window_tokens(int64_t w, uint32_t* out) const {
  MT_CHECK(w >= 0 && w < num_windows_, "data loader: window {} is outside [0, {})", w, num_windows_);
  const auto s = static_cast<size_t>(std::upper_bound(first_window_.begin(), first_window_.end(), w) -
                                     first_window_.begin() - 1);
  const int64_t start = (w - first_window_[s]) * options_.seq_len;
  shards_[s].read(start, options_.seq_len + 1, out);
}

void DataLoader::set_state(const LoaderState& state) {
  MT_CHECK(state.position >= 0 && state.position < num_windows_per_rank(),
           "data loader: resume position {} is outside [0, {}) (windows per rank per epoch); was the state saved "
           "with other data, seq_len or world size?",
           state.position, num_windows_per_rank());
  state_ = state;
}

Batch DataLoader::next() {
  const int64_t B = options_.batch_size, T = options_.seq_len;
  Batch batch{empty({B, T}, DType::i32), empty({B, T}, DType::i32)};
  int32_t* inputs = batch.inputs.data<int32_t>();
  int32_t* targets = batch.targets.data<int32_t>();
  std::vector<uint32_t> window(static_cast<size_t>(T + 1));  // ids < vocab_size <= INT32_MAX: checked at open
  for (int64_t b = 0; b < B; ++b) {
    window_tokens(window_at(state_.epoch, state_.position), window.data());
    const auto as_i32 = [](uint32_t id) { return static_cast<int32_t>(id); };
    std::transform(window.begin(), window.end() - 1, inputs + b * T, as_i32);
    std::transform(window.begin() + 1, window.end(), targets + b * T, as_i32);
    if (++state_.position == num_windows_per_rank()) {
      ++state_.epoch;
      state_.position = 0;
    }
  }
  return batch;
}

}  // namespace moetrain::data
