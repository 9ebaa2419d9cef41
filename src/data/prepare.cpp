// prepare_shards: text files -> llm.c token shards (conventions in prepare.h).
#include "data/prepare.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "data/utf8.h"
#include "io/durable.h"
#include "io/paths.h"

#include <spdlog/spdlog.h>

namespace moetrain::data {

std::string shard_file_name(const std::string& prefix, const std::string& split, int64_t index) {
  return fmt::format("{}{}{}_{:06}.bin", prefix, prefix.empty() ? "" : "_", split, index);
}

namespace {

namespace fs = std::filesystem;

// The staging directory in out_dir: "<prefix><host>.<pid>" (io/paths.h temp_entry_name).
constexpr const char* kStagingPrefix = ".prepare.tmp.";

// Reads a file in chunks of about chunk_bytes that end at a find_split_point,
// so each chunk tokenizes as it would inside the whole file. A chunk grows
// until a split point appears (or the file ends). With split false the one
// chunk is the whole file (a tokenizer whose pieces may span any cut).
class ChunkReader {
 public:
  ChunkReader(const std::string& path, size_t chunk_bytes, bool split = true)
      : path_(path), chunk_bytes_(std::max<size_t>(chunk_bytes, 1)), split_(split) {
    const int fd = open_regular_file(path, "a text file");  // never waits on a FIFO
    file_ = ::fdopen(fd, "rb");
    if (!file_) {
      const int err = errno;
      ::close(fd);
      throw IoError(fmt::format("{}: cannot open input: {}", path, std::strerror(err)));
    }
  }
  ~ChunkReader() {
    if (file_) std::fclose(file_);
  }
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  // The next chunk (valid until the next call) and its byte offset in the file; false at the end.
  bool next(std::string_view& chunk, int64_t& offset) {
    buf_.erase(0, taken_);  // drop the chunk returned last time
    offset_ += static_cast<int64_t>(taken_);
    taken_ = 0;
    for (;;) {
      if (!eof_) {
        const size_t old = buf_.size();
        buf_.resize(old + chunk_bytes_);
        const size_t got = std::fread(buf_.data() + old, 1, chunk_bytes_, file_);
        buf_.resize(old + got);
        if (got < chunk_bytes_) {
          if (std::ferror(file_))
            MT_THROW("{}: read error at byte offset {}: {}", path_, offset_ + old, std::strerror(errno));
          eof_ = true;
        }
      }
      if (eof_) {
        taken_ = buf_.size();
      } else {
        taken_ = split_ ? find_split_point(buf_, buf_.size()) : 0;
        if (taken_ == 0) continue;  // no split point yet: read more
      }
      if (taken_ == 0) return false;
      chunk = std::string_view(buf_).substr(0, taken_);
      offset = offset_;
      return true;
    }
  }

 private:
  std::string path_;
  size_t chunk_bytes_;
  bool split_;
  std::FILE* file_ = nullptr;
  std::string buf_;
  size_t taken_ = 0;    // bytes of buf_ handed out by the last next()
  int64_t offset_ = 0;  // file offset of buf_[0]
  bool eof_ = false;
};

// Throws naming file, byte offset and line of the first ill-formed UTF-8.
void check_utf8_file(const std::string& path, size_t chunk_bytes) {
  ChunkReader reader(path, chunk_bytes);
  std::string_view chunk;
  int64_t offset = 0, lines = 0;
  while (reader.next(chunk, offset)) {
    Utf8Error e = find_invalid_utf8(chunk);
    if (e.offset >= 0) {
      const int64_t line = lines + std::count(chunk.begin(), chunk.begin() + e.offset, '\n') + 1;
      MT_THROW("{}: {}, line {}; fix the file or pass --invalid-utf8 replace (U+FFFD for each bad sequence, as "
               "Python's errors=\"replace\")",
               path, describe_utf8_error(chunk, e, offset), line);
    }
    lines += std::count(chunk.begin(), chunk.end(), '\n');
  }
}

// Collects the token stream into a val shard and train shards in `dir`, of
// `width` ids (uint16 buffers for uint16 shards: half the memory).
class ShardSink {
 public:
  ShardSink(std::string dir, std::string prefix, int64_t val_tokens, int64_t shard_tokens, TokenWidth width,
            int32_t vocab_size)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), val_tokens_(val_tokens), shard_tokens_(shard_tokens),
        vocab_size_(vocab_size), val_(width), train_(width) {}

  void add(std::span<const int32_t> ids) {
    for (int32_t id : ids) {
      MT_ASSERT(id >= 0 && id < vocab_size_, "token id {} is outside the tokenizer's {} ids", id, vocab_size_);
      if (num_tokens_ < val_tokens_) {
        val_.push(static_cast<uint32_t>(id));
        if (val_.size() == val_tokens_) flush("val", val_);
      } else {
        train_.push(static_cast<uint32_t>(id));
        if (train_.size() == shard_tokens_) flush("train", train_);
      }
      ++num_tokens_;
    }
  }

  // Writes the last train shard; throws if the stream was too short for val + train.
  void finish() {
    MT_CHECK(num_tokens_ > val_tokens_,
             "the inputs make {} tokens, not more than --val-tokens = {}, which leaves none for train; lower "
             "--val-tokens",
             num_tokens_, val_tokens_);
    if (train_.size() > 0) flush("train", train_);
  }

  const std::vector<PreparedShard>& written() const { return written_; }  // file names, in order
  int64_t num_tokens() const { return num_tokens_; }

 private:
  // One shard's tokens, in the shard's width.
  struct Buffer {
    explicit Buffer(TokenWidth w) : width(w) {}
    TokenWidth width;
    std::vector<uint16_t> u16;
    std::vector<uint32_t> u32;
    void push(uint32_t id) {
      if (width == TokenWidth::u16) u16.push_back(static_cast<uint16_t>(id));
      else u32.push_back(id);
    }
    int64_t size() const { return static_cast<int64_t>(width == TokenWidth::u16 ? u16.size() : u32.size()); }
    void write(const std::string& path) const {
      if (width == TokenWidth::u16) write_shard(path, u16);
      else write_shard(path, u32, TokenWidth::u32);
    }
    void clear() {
      std::vector<uint16_t>().swap(u16);
      std::vector<uint32_t>().swap(u32);
    }
  };

  void flush(const std::string& split, Buffer& tokens) {
    const int64_t index = split == "val" ? 0 : num_train_shards_++;
    const std::string name = shard_file_name(prefix_, split, index);
    tokens.write(dir_ + "/" + name);
    written_.push_back({name, tokens.size()});
    tokens.clear();
  }

  std::string dir_, prefix_;
  int64_t val_tokens_, shard_tokens_;
  int32_t vocab_size_;
  Buffer val_, train_;
  int64_t num_tokens_ = 0, num_train_shards_ = 0;
  std::vector<PreparedShard> written_;
};

// The shards of this prefix already in `dir`: <prefix>val_NNNNNN.bin, <prefix>train_NNNNNN.bin.
std::vector<std::string> existing_shards(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    for (const char* split : {"val", "train"}) {
      const std::string head = shard_file_name(prefix, split, 0);  // "<prefix>val_000000.bin"
      const size_t stem = head.size() - std::string_view("000000.bin").size();
      if (name.size() == head.size() && name.compare(0, stem, head, 0, stem) == 0 && name.ends_with(".bin") &&
          std::all_of(name.begin() + stem, name.end() - 4, [](char c) { return c >= '0' && c <= '9'; }))
        found.push_back(dir + "/" + name);
    }
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

PrepareSummary prepare_shards(const PrepareOptions& o) {
  const double start = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  MT_CHECK(!o.inputs.empty(), "prepare: no input files");
  MT_CHECK(!o.out_dir.empty(), "prepare: no output directory (--out)");
  MT_CHECK(o.val_tokens >= 0, "prepare: --val-tokens = {} must be >= 0", o.val_tokens);
  MT_CHECK(o.shard_tokens >= 1 && o.shard_tokens <= kShardMaxTokens, "prepare: --shard-tokens = {} must be in [1, {}]",
           o.shard_tokens, kShardMaxTokens);
  MT_CHECK(o.name.find('/') == std::string::npos, "prepare: --name \"{}\" must not contain '/'", o.name);

  // Inputs first: nothing is written unless every input can be read.
  PrepareSummary summary;
  for (const std::string& input : o.inputs) {
    require_regular_file(input, "a text file");
    struct stat st {};
    if (::stat(input.c_str(), &st) != 0) MT_THROW("{}: cannot open input: {}", input, std::strerror(errno));
    MT_CHECK(::access(input.c_str(), R_OK) == 0, "{}: cannot read input: {}", input, std::strerror(errno));
    summary.num_bytes += static_cast<int64_t>(st.st_size);
  }
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(o.tokenizer, o.tokenizer_dir);
  const TokenWidth width = shard_width_for_vocab(tokenizer->vocab_size());  // uint32 only where uint16 cannot hold it
  const bool needs_utf8 = tokenizer->needs_utf8();
  summary.tokenizer = tokenizer->name();
  summary.width = width;
  if (needs_utf8 && !o.replace_invalid_utf8)
    for (const std::string& input : o.inputs) check_utf8_file(input, o.chunk_bytes);

  std::error_code ec;
  moetrain::create_directories(o.out_dir);  // IoError naming it
  const std::vector<std::string> stale = existing_shards(o.out_dir, o.name);
  MT_CHECK(stale.empty() || o.overwrite,
           "{}: already holds {} shard(s) named {}* ({}{}); pass --overwrite to replace them, or choose another --out "
           "or --name",
           o.out_dir, stale.size(), o.name.empty() ? "val_/train_" : o.name + "_", stale.front(),
           stale.size() > 1 ? ", ..." : "");

  // Each shard is renamed over its name in out_dir: a directory, device or FIFO of a shard's name is refused
  // now, before any work; the names of the shards written are checked again before the first rename.
  for (const std::string& old : stale) check_output_file(old, "prepare --out: the shard");

  // The staging directories of earlier runs into this out_dir that were killed on this host.
  for (const fs::path& left : remove_stale_temp_entries(o.out_dir, kStagingPrefix))
    spdlog::info("removed {}, the staging directory of an earlier prepare that did not finish", left.string());

  // Staging directory: removed on every exit, renamed-from on success.
  const std::string staging = o.out_dir + "/" + temp_entry_name(kStagingPrefix);
  fs::remove_all(staging, ec);
  if (::mkdir(staging.c_str(), 0777) != 0)
    throw IoError(fmt::format("{}: cannot create the staging directory: {}", staging, std::strerror(errno)));
  struct RemoveStaging {
    std::string dir;
    ~RemoveStaging() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } remove_staging{staging};

  ShardSink sink(staging, o.name, o.val_tokens, o.shard_tokens, width, tokenizer->vocab_size());
  try {
    ProgressOptions popt = o.progress;
    popt.unit = std::string("B");  // not = "B": GCC 12 -Wrestrict false positive (PR 105329)
    popt.scale = true;
    Progress progress("tokenizing", summary.num_bytes, popt);
    const DocumentTokens around = tokenizer->document_tokens();
    for (const std::string& input : o.inputs) {
      sink.add(around.prefix);
      ChunkReader reader(input, o.chunk_bytes, tokenizer->encodes_in_chunks());
      std::string_view chunk;
      int64_t offset = 0;
      std::string repaired;
      while (reader.next(chunk, offset)) {
        const auto chunk_bytes = static_cast<int64_t>(chunk.size());
        if (needs_utf8 && o.replace_invalid_utf8) {
          int64_t replaced = 0;
          repaired = replace_invalid_utf8(chunk, &replaced);
          summary.num_replaced += replaced;
          if (replaced > 0) chunk = repaired;
        }
        std::vector<int32_t> ids;
        try {
          ids = tokenizer->encode(chunk);
        } catch (const Error& e) {
          MT_THROW("{}: in the chunk at byte offset {}: {}", input, offset, e.what());
        }
        sink.add(ids);
        const double seconds = progress.elapsed_s();
        progress.set_postfix(fmt::format(
            "{} tok, {} tok/s", Progress::format_count(static_cast<double>(sink.num_tokens()), true),
            Progress::format_count(seconds > 0 ? static_cast<double>(sink.num_tokens()) / seconds : 0.0, true)));
        progress.update(chunk_bytes);
      }
      sink.add(around.suffix);
      ++summary.num_documents;
    }
    sink.finish();
    progress.finish();
  } catch (const IoError& e) {
    // The shard was being written in the staging directory, which is gone now.
    throw IoError(fmt::format("prepare --out {}: {}; nothing was written to {}", o.out_dir, e.what(), o.out_dir));
  }

  // Publish: remove stale shards of this prefix, then move the new ones in.
  for (const std::string& old : stale) {
    const std::string name = fs::path(old).filename().string();
    const auto& w = sink.written();
    if (std::none_of(w.begin(), w.end(), [&](const PreparedShard& s) { return s.path == name; }))
      if (::unlink(old.c_str()) != 0 && errno != ENOENT)
        throw IoError(fmt::format("{}: cannot remove the stale shard: {}", old, std::strerror(errno)));
  }
  for (const PreparedShard& s : sink.written())
    check_output_file(o.out_dir + "/" + s.path, "prepare --out: the shard");  // before the first rename
  for (const PreparedShard& s : sink.written()) {
    const std::string from = staging + "/" + s.path, to = o.out_dir + "/" + s.path;
    if (::rename(from.c_str(), to.c_str()) != 0)
      throw IoError(fmt::format("{}: cannot move the shard into place: {}", to, std::strerror(errno)));
    summary.shards.push_back({to, s.num_tokens});
  }
  summary.num_tokens = sink.num_tokens();
  summary.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count() - start;
  return summary;
}

}  // namespace moetrain::data
