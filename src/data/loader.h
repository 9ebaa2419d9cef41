// DataLoader: batches of token windows from llm.c token shards (data/shard.h).
//
// Windows. Shard s with n_s tokens holds windows of T+1 tokens starting at
// token 0, T, 2T, ... while they fit (floor((n_s - 1) / T) of them); a window
// never crosses a shard boundary, and a shard's last < T+1 tokens past its
// final window are not used. Windows are numbered 0..num_windows()-1 through
// the shards in file order (files sorted by name). A window gives one batch
// row: inputs = its tokens 0..T-1, targets = tokens 1..T (the next token).
//
// Order. Shuffled: epoch e visits the windows in a permutation drawn from
// (seed, e) by Fisher-Yates on Philox counters (core/rng.h), so every machine
// and thread count sees the same order. Sequential (validation, eval): window
// order, every epoch; window i covers tokens iT..iT+T of its shard (rows from
// shard-relative offsets as above), target of position t is token t+1.
//
// Data parallelism. With world_size W, rank r takes entries r, r+W, r+2W, ...
// of the epoch's order: floor(num_windows / W) windows each, so all ranks run
// the same number of batches; the num_windows % W windows left at the end of
// the order are skipped that epoch (other windows each epoch when shuffled).
//
// Batches. next() takes the next B windows of this rank's stream, continuing
// into the next epoch when one ends (a batch may straddle two epochs). state()
// is (epoch, windows taken in it); set_state() resumes exactly there.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/shard.h"

namespace moetrain::data {

struct Batch {
  Tensor inputs;   // [B, T] i32
  Tensor targets;  // [B, T] i32: inputs shifted left by one token
};

struct LoaderState {
  uint64_t epoch = 0;    // epoch of this rank's next window
  int64_t position = 0;  // windows this rank has taken in that epoch, in [0, num_windows_per_rank())
  bool operator==(const LoaderState&) const = default;
};

enum class LoaderOrder { shuffled, sequential };

struct DataLoaderOptions {
  int64_t batch_size = 1;          // B
  int64_t seq_len = 1024;          // T
  int64_t vocab_size = 50257;      // every token id must be below this (checked at open); <= INT32_MAX
  int64_t tokenizer_vocab_size = 0;  // the ids of the tokenizer the shards should come from; 0: unknown.
                                     // Above 65536 a uint16 shard is refused (made by another tokenizer).
  uint64_t seed = 0;               // of the shuffled order
  int rank = 0;                    // data-parallel rank in [0, world_size)
  int world_size = 1;
  LoaderOrder order = LoaderOrder::shuffled;
};

// Files matching a glob(3) pattern ("data/shakespeare/train_*.bin"), sorted by
// name (byte order). Throws moetrain::Error naming the pattern if nothing matches.
std::vector<std::string> expand_shard_pattern(const std::string& pattern);

class DataLoader {
 public:
  // Opens every shard and checks it (format, uint16 or uint32 ids, token ids <
  // vocab_size: an error names the file and the token offset) and that each rank
  // gets at least one batch per epoch.
  DataLoader(const std::string& pattern, const DataLoaderOptions& options);
  DataLoader(std::vector<std::string> files, const DataLoaderOptions& options);

  Batch next();

  LoaderState state() const { return state_; }
  // Throws moetrain::Error if position is outside [0, num_windows_per_rank()).
  void set_state(const LoaderState& state);

  int64_t num_windows() const { return num_windows_; }  // in the whole corpus, all ranks together
  int64_t num_windows_per_rank() const { return num_windows_ / options_.world_size; }
  int64_t num_tokens() const { return num_tokens_; }    // in all shards
  const std::vector<std::string>& files() const { return files_; }
  const DataLoaderOptions& options() const { return options_; }

  // The window this rank takes as the k-th of epoch `epoch` (k < num_windows_per_rank()).
  int64_t window_at(uint64_t epoch, int64_t k) const;
  // The T+1 tokens of window w (< num_windows()) into out, whatever the shard's width.
  void window_tokens(int64_t w, uint32_t* out) const;

 private:
  void open(const std::string& source);
  const std::vector<uint32_t>& permutation(uint64_t epoch) const;

  DataLoaderOptions options_;
  std::vector<std::string> files_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> first_window_;  // [num shards + 1]: index of each shard's first window
  int64_t num_windows_ = 0;
  int64_t num_tokens_ = 0;
  LoaderState state_;
  mutable uint64_t perm_epoch_ = 0;  // the epoch whose permutation perm_ holds
  mutable std::vector<uint32_t> perm_;
};

}  // namespace moetrain::data
