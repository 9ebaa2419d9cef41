// Token shards in llm.c's format (llm.c dev/data/data_common.py, write_datafile:
// HEADERS_INFO "gpt-2" and "llama-3"), so shards made by either tool load in the
// other. Two token widths share one layout:
//
//   offset 0      int32 magic    20240520 (uint16 ids) or 20240801 (uint32 ids)
//   offset 4      int32 version  1                     or 7
//   offset 8      int32 number of tokens N
//   offset 12     int32 x 253    zero
//   offset 1024   uint16 x N or uint32 x N: the token ids
//
// All little-endian. A uint16 shard holds ids below 65536 (GPT-2: 50257); a
// vocabulary of more than 65536 ids (Llama 3: 128256) needs uint32 shards.
// `prepare` writes uint16 when the tokenizer's vocabulary fits, uint32 otherwise
// (shard_width_for_vocab); everything that reads shards reads both, as uint32.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moetrain::data {

// The width of a shard's token ids; the value is bytes per token.
enum class TokenWidth : int { u16 = 2, u32 = 4 };

inline constexpr int32_t kShardMagic = 20240520;  // uint16 ids (llm.c "gpt-2")
inline constexpr int32_t kShardVersion = 1;
inline constexpr int32_t kShardMagic32 = 20240801;  // uint32 ids (llm.c "llama-3")
inline constexpr int32_t kShardVersion32 = 7;
inline constexpr int64_t kShardMaxId16 = 65535;  // the largest id a uint16 shard holds
inline constexpr int64_t kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
inline constexpr int64_t kShardMaxTokens = 2147483647;  // the header's int32 count

// uint16 for a vocabulary of at most 65536 ids, uint32 above (the narrowest that
// holds every id below vocab_size >= 1).
TokenWidth shard_width_for_vocab(int64_t vocab_size);
// "uint16" or "uint32".
const char* token_width_name(TokenWidth width);

// Writes a shard atomically: to a temporary name in the same directory, then
// fsync and rename, so `path` is either absent/old or complete, never partial.
// Throws moetrain::Error naming `path` for too many tokens or a `path` that exists and
// is not a regular file (io/paths.h check_output_file); IoError (exit code 5) with
// the system's message when creating, writing, syncing or renaming fails.
// The uint16 overload writes a uint16 shard; the uint32 one writes `width`: with
// TokenWidth::u16 every id must be below 65536 (an Error naming `path`, the id and
// its token offset otherwise, before anything is created), narrowed in blocks as
// it is written (no copy of the tokens).
void write_shard(const std::string& path, std::span<const uint16_t> tokens);
void write_shard(const std::string& path, std::span<const uint32_t> tokens, TokenWidth width);

// A shard opened read-only and checked at open: the file exists and is a regular
// file (a FIFO or a device is refused, not waited on: io/paths.h), holds a whole
// header, has one of the two magics above with its version, and exactly
// 1024 + 2N (uint16) or 1024 + 4N (uint32) bytes. A failed
// check throws moetrain::Error: one line naming the file, the byte offset where
// one applies, and what was expected. Tokens are read with pread, window by
// window, not mapped: a shard truncated while a run reads it is an IoError naming
// the file and the offset (exit 5), where a mapping would die of SIGBUS. The cost
// is one system call per window (T + 1 tokens) from the page cache. Move-only.
class TokenShard {
 public:
  explicit TokenShard(std::string path);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return num_tokens_; }
  TokenWidth width() const { return width_; }
  int64_t bytes_per_token() const { return static_cast<int64_t>(width_); }
  // Tokens [first, first + count) into out, as uint32 whatever the width (a
  // uint16 shard's ids are read into out's bytes and widened in place).
  void read(int64_t first, int64_t count, uint32_t* out) const;
  std::vector<uint32_t> read_all() const;

 private:
  void read_bytes(int64_t offset, void* out, int64_t n) const;

  std::string path_;
  int fd_ = -1;
  int64_t num_tokens_ = 0;
  TokenWidth width_ = TokenWidth::u16;
};

// The tokens of the shard at `path`, copied (tests, small files).
std::vector<uint32_t> read_shard(const std::string& path);

}  // namespace moetrain::data
