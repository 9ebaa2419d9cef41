// prepare_shards: text files -> llm.c token shards (conventions in prepare.h).
#include "data/prepare.h"

#include <omp.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <exception>
#include <memory>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/corpus.h"
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

// Reads a file in chunks of about chunk_bytes that end at the tokenizer's
// find_cut (find_split_point without a tokenizer), so each chunk tokenizes as it
// would inside the whole file. A chunk grows until a cut appears (or the file
// ends). With a tokenizer that cannot be cut (encodes_in_chunks false) the one
// chunk is the whole file.
class ChunkReader {
 public:
  ChunkReader(const CorpusInput& input, size_t chunk_bytes, const Tokenizer* tok = nullptr, bool repair = false)
      : path_(input.path), chunk_bytes_(std::max<size_t>(chunk_bytes, 1)), tok_(tok), repair_(repair),
        split_(tok == nullptr || tok->encodes_in_chunks()), source_(open_corpus_source(input)) {}

  // The next chunk (valid until the next call) and its byte offset in the file; false at the end.
  bool next(std::string_view& chunk, int64_t& offset) {
    buf_.erase(0, taken_);  // drop the chunk returned last time
    offset_ += static_cast<int64_t>(taken_);
    taken_ = 0;
    for (;;) {
      if (!eof_) {
        // chunk_bytes more, or as much as is held when no cut appeared in it: the
        // search for a cut then costs a constant factor over the text, not its square.
        const size_t old = buf_.size(), want = std::max(chunk_bytes_, old);
        buf_.resize(old + want);
        size_t got = 0;
        while (got < want) {  // a decompressor may return less than asked before the end
          const size_t n = source_->read(buf_.data() + old + got, want - got);
          if (n == 0) break;
          got += n;
        }
        buf_.resize(old + got);
        if (got < want) eof_ = true;
      }
      if (eof_) {
        taken_ = buf_.size();
      } else {
        taken_ = !split_ ? 0 : tok_ ? tok_->find_cut(buf_, repair_) : find_split_point(buf_, buf_.size());
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
  const Tokenizer* tok_;
  bool repair_;
  bool split_;
  std::unique_ptr<CorpusSource> source_;
  std::string buf_;
  size_t taken_ = 0;    // bytes of buf_ handed out by the last next()
  int64_t offset_ = 0;  // file offset of buf_[0]
  bool eof_ = false;
};

// Throws naming file, byte offset and line of the first ill-formed UTF-8.
void check_utf8_file(const CorpusInput& input, size_t chunk_bytes) {
  const std::string& path = input.path;
  ChunkReader reader(input, chunk_bytes);
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

// One piece of work: a chunk of a text document or one JSONL line, encoded on
// some thread; its ids join the stream in input order, whatever the thread.
struct PrepareUnit {
  std::string text;  // the chunk, or the JSONL line (the document after encode())
  bool jsonl = false;
  bool starts = false, ends = false;  // the document's first / last unit
  std::string where;                  // "file: in the chunk at byte offset N" or "file:line"
  int64_t source_bytes = 0, text_bytes = 0, replaced = 0;
  std::vector<int32_t> ids;
  std::exception_ptr error;
};

// Units collected up to a byte budget, then encoded in parallel (OpenMP,
// dynamic schedule). Each unit's ids depend only on its text, so the stream is
// the same for any number of threads; memory is the budget plus its ids.
class PrepareBatch {
 public:
  PrepareBatch(const Tokenizer& tok, const PrepareOptions& o, int threads, bool repair)
      : tok_(tok), text_field_(o.text_field), threads_(threads), repair_(repair),
        budget_(std::max<size_t>(o.chunk_bytes, 1) * static_cast<size_t>(std::max(threads, 1)) * 2) {}

  PrepareUnit& add(std::string text, bool jsonl) {
    bytes_ += text.size() + 64;
    units.emplace_back();
    units.back().text = std::move(text);
    units.back().jsonl = jsonl;
    return units.back();
  }
  bool full() const { return bytes_ >= budget_; }
  void clear() {
    units.clear();
    bytes_ = 0;
  }

  void encode() {
    const auto n = static_cast<int64_t>(units.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_)
    for (int64_t i = 0; i < n; ++i) {
      PrepareUnit& u = units[i];
      try {
        if (u.jsonl) u.text = document_of_line(u.text);
        if (repair_) {
          std::string fixed = replace_invalid_utf8(u.text, &u.replaced);
          if (u.replaced > 0) u.text.swap(fixed);
        }
        u.text_bytes = static_cast<int64_t>(u.text.size());
        u.ids = tok_.encode(u.text);
      } catch (...) {
        u.error = std::current_exception();
      }
      std::string().swap(u.text);
    }
  }

  std::vector<PrepareUnit> units;

 private:
  // The text field of one JSONL line.
  std::string document_of_line(const std::string& line) const {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(repair_ ? replace_invalid_utf8(line) : line);
    } catch (const nlohmann::json::exception& e) {
      MT_THROW("not a JSON line ({})", e.what());
    }
    if (!j.is_object()) MT_THROW("expected a JSON object with a string \"{}\", found a {}", text_field_, j.type_name());
    auto it = j.find(text_field_);
    if (it == j.end() || !it->is_string())
      MT_THROW("no string field \"{}\" (--text-field names the field that holds the document)", text_field_);
    return it->get<std::string>();
  }

  const Tokenizer& tok_;
  std::string text_field_;
  int threads_;
  bool repair_;
  size_t budget_;
  size_t bytes_ = 0;
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
  const std::vector<CorpusInput> inputs = expand_corpus_inputs(o.inputs);
  int64_t total_bytes = 0;  // for the progress report; unknown (0) with stdin or a compressed input
  bool total_known = true;
  for (const CorpusInput& input : inputs) {
    if (input.is_stdin()) {
      total_known = false;
      continue;
    }
    require_regular_file(input.path, "an input file");
    struct stat st {};
    if (::stat(input.path.c_str(), &st) != 0) MT_THROW("{}: cannot open input: {}", input.path, std::strerror(errno));
    MT_CHECK(::access(input.path.c_str(), R_OK) == 0, "{}: cannot read input: {}", input.path, std::strerror(errno));
    total_bytes += static_cast<int64_t>(st.st_size);
    if (input.compression != CorpusCompression::none) total_known = false;
  }
  MT_CHECK(o.threads >= 0, "prepare: --threads = {} must be >= 0 (0: all cores)", o.threads);
  const int threads = o.threads > 0 ? o.threads : std::max(1, omp_get_max_threads());  // moetrain --threads
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(o.tokenizer, o.tokenizer_dir, o.tiktoken);
  const TokenWidth width = shard_width_for_vocab(tokenizer->vocab_size());  // uint32 only where uint16 cannot hold it
  const bool needs_utf8 = tokenizer->needs_utf8();
  summary.tokenizer = tokenizer->name();
  summary.width = width;
  // Plain text files are checked whole before anything is written; JSONL lines and
  // compressed files are checked as they are read (the staging directory keeps
  // out_dir as it was on an error).
  if (needs_utf8 && !o.replace_invalid_utf8)
    for (const CorpusInput& input : inputs)
      if (input.format == CorpusFormat::text && input.compression == CorpusCompression::none && !input.is_stdin())
        check_utf8_file(input, o.chunk_bytes);

  std::error_code ec;
  moetrain::create_directories(o.out_dir);  // IoError naming it
  // One prepare at a time per out_dir: two would each see no shards, then move theirs
  // in over each other (a mix of both runs). flock on the directory itself (no file
  // left behind), released when the process ends.
  const int lock_fd = ::open(o.out_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (lock_fd < 0) throw IoError(fmt::format("{}: cannot open the directory: {}", o.out_dir, std::strerror(errno)));
  struct CloseLock {
    int fd;
    ~CloseLock() { ::close(fd); }
  } close_lock{lock_fd};
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    MT_CHECK(err != EWOULDBLOCK, "prepare --out {}: another prepare is writing shards into it now (the directory is "
                                 "locked); wait for it to finish or choose another --out",
             o.out_dir);
    throw IoError(fmt::format("{}: cannot lock the directory: {}", o.out_dir, std::strerror(err)));
  }
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
    Progress progress("tokenizing", total_known ? total_bytes : 0, popt);
    const DocumentTokens around = tokenizer->document_tokens();
    PrepareBatch batch(*tokenizer, o, threads, needs_utf8 && o.replace_invalid_utf8);
    auto flush = [&] {
      batch.encode();
      for (PrepareUnit& u : batch.units) {
        if (u.error) {
          try {
            std::rethrow_exception(u.error);
          } catch (const IoError&) {
            throw;
          } catch (const Error& e) {
            MT_THROW("{}: {}", u.where, e.what());
          }
        }
        if (u.starts) sink.add(around.prefix);
        sink.add(u.ids);
        if (u.ends) {
          sink.add(around.suffix);
          ++summary.num_documents;
        }
        summary.num_bytes += u.text_bytes;
        summary.num_replaced += u.replaced;
        progress.update(u.source_bytes);
      }
      const double seconds = progress.elapsed_s();
      progress.set_postfix(fmt::format(
          "{} tok, {} tok/s", Progress::format_count(static_cast<double>(sink.num_tokens()), true),
          Progress::format_count(seconds > 0 ? static_cast<double>(sink.num_tokens()) / seconds : 0.0, true)));
      batch.clear();
    };
    for (const CorpusInput& input : inputs) {
      if (input.format == CorpusFormat::text) {
        ChunkReader reader(input, o.chunk_bytes, tokenizer.get(), needs_utf8 && o.replace_invalid_utf8);
        std::string_view chunk;
        int64_t offset = 0;
        bool first = true;
        while (reader.next(chunk, offset)) {
          PrepareUnit& u = batch.add(std::string(chunk), false);
          u.starts = first;
          u.where = fmt::format("{}: in the chunk at byte offset {}", input.path, offset);
          u.source_bytes = static_cast<int64_t>(chunk.size());
          first = false;
          if (batch.full()) flush();
        }
        PrepareUnit& end = batch.add(std::string(), false);  // the document's end (an empty file is one too)
        end.starts = first;
        end.ends = true;
        end.where = input.path;
        if (batch.full()) flush();
      } else {
        std::unique_ptr<CorpusSource> source = open_corpus_source(input);
        CorpusLineReader lines(*source);
        std::string_view line;
        int64_t line_no = 0;
        while (lines.next(line, line_no)) {
          const int64_t line_bytes = static_cast<int64_t>(line.size()) + 1;
          if (line.find_first_not_of(" \t\r") == std::string_view::npos) {
            progress.update(line_bytes);
            continue;  // blank lines hold no document
          }
          PrepareUnit& u = batch.add(std::string(line), true);
          u.starts = u.ends = true;
          u.where = fmt::format("{}:{}", input.is_stdin() ? "<stdin>" : input.path, line_no);
          u.source_bytes = line_bytes;
          if (batch.full()) flush();
        }
      }
    }
    flush();
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
