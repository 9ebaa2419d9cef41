// prepare's inputs: argument expansion and decompressing readers (corpus.h).
#include "data/corpus.h"

#include <glob.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"
#include "io/paths.h"

namespace moetrain::data {

namespace {

namespace fs = std::filesystem;

bool corpus_ends_with(std::string_view s, std::string_view suffix) { return s.ends_with(suffix); }

CorpusInput corpus_classify(const std::string& path) {
  CorpusInput in;
  in.path = path;
  std::string_view name = path;
  if (corpus_ends_with(name, ".gz")) {
    in.compression = CorpusCompression::gzip;
    name.remove_suffix(3);
  } else if (corpus_ends_with(name, ".zst")) {
    in.compression = CorpusCompression::zstd;
    name.remove_suffix(4);
  }
  in.format = corpus_ends_with(name, ".jsonl") ? CorpusFormat::jsonl : CorpusFormat::text;
  return in;
}

// The names a directory contributes: text and JSONL files, maybe compressed.
bool corpus_known_suffix(const std::string& name) {
  for (const char* s : {".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".txt.zst", ".jsonl.zst"})
    if (corpus_ends_with(name, s)) return true;
  return false;
}

void corpus_expand_directory(const std::string& arg, const std::string& dir, std::vector<CorpusInput>& out) {
  std::vector<std::string> found;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec))
    if (it->is_regular_file(ec) && corpus_known_suffix(it->path().filename().string()))
      found.push_back(it->path().string());
  if (ec) throw IoError(fmt::format("{}: cannot list the directory: {}", dir, ec.message()));
  std::sort(found.begin(), found.end());
  MT_CHECK(!found.empty(), "prepare: the directory {} holds no .txt, .jsonl, .txt.gz, .jsonl.gz, .txt.zst or "
                           ".jsonl.zst file",
           arg);
  for (const std::string& f : found) out.push_back(corpus_classify(f));
}

}  // namespace

std::vector<CorpusInput> expand_corpus_inputs(const std::vector<std::string>& args) {
  std::vector<CorpusInput> out;
  bool have_stdin = false;
  for (const std::string& arg : args) {
    if (arg == "-") {
      MT_CHECK(!have_stdin, "prepare: \"-\" (JSONL on standard input) is given twice");
      have_stdin = true;
      CorpusInput in;
      in.path = "-";
      in.format = CorpusFormat::jsonl;
      out.push_back(in);
      continue;
    }
    std::error_code ec;
    if (fs::is_directory(arg, ec)) {
      corpus_expand_directory(arg, arg, out);
      continue;
    }
    if (arg.find_first_of("*?[") != std::string::npos && !fs::exists(arg, ec)) {
      glob_t g{};
      const int rc = ::glob(arg.c_str(), 0, nullptr, &g);
      std::vector<std::string> matches;
      for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) matches.emplace_back(g.gl_pathv[i]);
      ::globfree(&g);
      MT_CHECK(!matches.empty(), "prepare: {} matches no file", arg);
      std::sort(matches.begin(), matches.end());
      for (const std::string& m : matches) {
        if (fs::is_directory(m, ec)) corpus_expand_directory(m, m, out);
        else out.push_back(corpus_classify(m));
      }
      continue;
    }
    out.push_back(corpus_classify(arg));  // checked when opened: exists, a regular file
  }
  return out;
}

namespace {

class CorpusFileSource final : public CorpusSource {
 public:
  explicit CorpusFileSource(const std::string& path) : path_(path) {
    const int fd = open_regular_file(path, "an input file");  // never waits on a FIFO
    file_ = ::fdopen(fd, "rb");
    if (!file_) {
      const int err = errno;
      ::close(fd);
      throw IoError(fmt::format("{}: cannot open input: {}", path, std::strerror(err)));
    }
  }
  explicit CorpusFileSource(std::FILE* stdin_file) : path_("-"), file_(stdin_file), owned_(false) {}
  ~CorpusFileSource() override {
    if (file_ && owned_) std::fclose(file_);
  }
  size_t read(char* buf, size_t n) override {
    const size_t got = std::fread(buf, 1, n, file_);
    if (got < n && std::ferror(file_))
      throw IoError(fmt::format("{}: read error at byte offset {}: {}", path_, offset_ + got, std::strerror(errno)));
    offset_ += static_cast<int64_t>(got);
    return got;
  }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  bool owned_ = true;
  int64_t offset_ = 0;
};

class CorpusGzipSource final : public CorpusSource {
 public:
  explicit CorpusGzipSource(const std::string& path) : path_(path) {
    const int fd = open_regular_file(path, "an input file");
    gz_ = ::gzdopen(fd, "rb");
    if (gz_ == nullptr) {
      ::close(fd);
      throw IoError(fmt::format("{}: cannot open the gzip stream", path));
    }
    ::gzbuffer(gz_, 1 << 18);
  }
  ~CorpusGzipSource() override { ::gzclose(gz_); }
  size_t read(char* buf, size_t n) override {
    const int want = static_cast<int>(std::min<size_t>(n, size_t{1} << 30));
    const int got = ::gzread(gz_, buf, static_cast<unsigned>(want));
    int code = Z_OK;
    const char* msg = ::gzerror(gz_, &code);
    // gzread passes a file that is not gzip through as it is, and ends a
    // truncated stream quietly: both are errors for a .gz input.
    if (got < 0 || (code != Z_OK && code != Z_STREAM_END))
      MT_THROW("{}: not a readable gzip file: {}", path_, msg != nullptr && *msg ? msg : "unknown error");
    if (got > 0 && ::gzdirect(gz_) != 0) MT_THROW("{}: not a gzip file (no gzip header)", path_);
    return static_cast<size_t>(got);
  }

 private:
  std::string path_;
  gzFile gz_ = nullptr;
};

class CorpusZstdSource final : public CorpusSource {
 public:
  explicit CorpusZstdSource(const std::string& path) : path_(path), file_(path), in_(ZSTD_DStreamInSize()) {
    ctx_ = ZSTD_createDCtx();
    MT_CHECK(ctx_ != nullptr, "{}: out of memory for the zstd decoder", path);
  }
  ~CorpusZstdSource() override { ZSTD_freeDCtx(ctx_); }
  size_t read(char* buf, size_t n) override {
    ZSTD_outBuffer out{buf, n, 0};
    while (out.pos == 0) {
      if (pos_ == have_) {
        have_ = file_.read(in_.data(), in_.size());
        pos_ = 0;
        if (have_ == 0) {
          MT_CHECK(last_ret_ == 0, "{}: the zstd stream ends inside a frame (truncated file?)", path_);
          return 0;
        }
      }
      ZSTD_inBuffer in{in_.data(), have_, pos_};
      const size_t ret = ZSTD_decompressStream(ctx_, &out, &in);
      if (ZSTD_isError(ret)) MT_THROW("{}: not a readable zstd file: {}", path_, ZSTD_getErrorName(ret));
      last_ret_ = ret;
      pos_ = in.pos;
    }
    return out.pos;
  }

 private:
  std::string path_;
  CorpusFileSource file_;
  std::vector<char> in_;
  size_t have_ = 0, pos_ = 0, last_ret_ = 0;
  ZSTD_DCtx* ctx_ = nullptr;
};

}  // namespace

std::unique_ptr<CorpusSource> open_corpus_source(const CorpusInput& input) {
  if (input.is_stdin()) return std::make_unique<CorpusFileSource>(stdin);
  switch (input.compression) {
    case CorpusCompression::gzip: return std::make_unique<CorpusGzipSource>(input.path);
    case CorpusCompression::zstd: return std::make_unique<CorpusZstdSource>(input.path);
    case CorpusCompression::none: break;
  }
  return std::make_unique<CorpusFileSource>(input.path);
}

bool CorpusLineReader::next(std::string_view& line, int64_t& line_no) {
  for (;;) {
    const size_t nl = buf_.find('\n', begin_);
    if (nl != std::string::npos) {
      line = std::string_view(buf_).substr(begin_, nl - begin_);
      begin_ = nl + 1;
      line_no = ++line_no_;
      return true;
    }
    if (eof_) {
      if (begin_ >= buf_.size()) return false;
      line = std::string_view(buf_).substr(begin_);
      begin_ = buf_.size();
      line_no = ++line_no_;
      return true;
    }
    buf_.erase(0, begin_);  // keep the unfinished line, read more
    begin_ = 0;
    const size_t old = buf_.size(), want = std::max<size_t>(size_t{1} << 20, old);
    buf_.resize(old + want);
    const size_t got = source_.read(buf_.data() + old, want);
    buf_.resize(old + got);
    if (got == 0) eof_ = true;
  }
}

}  // namespace moetrain::data
