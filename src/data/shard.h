// Token shards in llm.c's format (llm.c dev/data/data_common.py, write_datafile
// with model_desc "gpt-2"), so shards made by either tool load in the other:
//
//   offset 0      int32 magic    20240520
//   offset 4      int32 version  1
//   offset 8      int32 number of tokens N
//   offset 12     int32 x 253    zero
//   offset 1024   uint16 x N     the token ids
//
// All little-endian. Ids are uint16, so a vocabulary has at most 65536 tokens
// (GPT-2: 50257). llm.c's uint32 variant (magic 20240801, version 7) is not read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moetrain::data {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
inline constexpr int64_t kShardMaxTokens = 2147483647;  // the header's int32 count

// Writes a shard atomically: to a temporary name in the same directory, then
// fsync and rename, so `path` is either absent/old or complete, never partial.
// Throws moetrain::Error naming `path` for too many tokens or a `path` that exists and
// is not a regular file (io/paths.h check_output_file); IoError (exit code 5) with
// the system's message when creating, writing, syncing or renaming fails.
void write_shard(const std::string& path, std::span<const uint16_t> tokens);

// A shard opened read-only and checked at open: the file exists and is a regular
// file (a FIFO or a device is refused, not waited on: io/paths.h), holds a whole
// header, has the magic and version above, and exactly 1024 + 2N bytes. A failed
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
  // Tokens [first, first + count) into out.
  void read(int64_t first, int64_t count, uint16_t* out) const;
  std::vector<uint16_t> read_all() const;

 private:
  void read_bytes(int64_t offset, void* out, int64_t n) const;

  std::string path_;
  int fd_ = -1;
  int64_t num_tokens_ = 0;
};

// The tokens of the shard at `path`, copied (tests, small files).
std::vector<uint16_t> read_shard(const std::string& path);

}  // namespace moetrain::data
