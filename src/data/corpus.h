// The inputs of `moetrain prepare`: which files a command line names and how
// their bytes are read.
//
// An argument is a file, a directory (every file below it whose name ends in
// one of the suffixes below, recursively, in byte order of the path), a glob
// (*, ? or [...]: its matches in byte order; a directory among them is expanded
// as above) or "-" (JSONL on standard input, so a parquet reader can stream into
// prepare). The format follows the name: .jsonl is JSON Lines (one document per
// line: an object whose text field holds the document; blank lines are
// skipped), anything else is text (one document per file); either may end in
// .gz (zlib) or .zst (zstd) and is then decompressed as it is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moetrain::data {

enum class CorpusFormat { text, jsonl };
enum class CorpusCompression { none, gzip, zstd };

struct CorpusInput {
  std::string path;  // "-" for standard input
  CorpusFormat format = CorpusFormat::text;
  CorpusCompression compression = CorpusCompression::none;
  bool is_stdin() const { return path == "-"; }
};

// The inputs of `args`, in order. Throws moetrain::Error naming the argument
// when a path does not exist, a glob or directory matches no input file, or
// "-" is given twice.
std::vector<CorpusInput> expand_corpus_inputs(const std::vector<std::string>& args);

// The decompressed bytes of one input, read front to back.
class CorpusSource {
 public:
  virtual ~CorpusSource() = default;
  // Up to n bytes into buf; 0 at the end. Throws IoError / Error naming the file
  // (and for a damaged .gz / .zst the decompressor's message).
  virtual size_t read(char* buf, size_t n) = 0;
};
std::unique_ptr<CorpusSource> open_corpus_source(const CorpusInput& input);

// Splits a source into lines (without the '\n'; a final line without one counts).
class CorpusLineReader {
 public:
  explicit CorpusLineReader(CorpusSource& source) : source_(source) {}
  // The next line (valid until the next call) and its number from 1; false at the end.
  bool next(std::string_view& line, int64_t& line_no);

 private:
  CorpusSource& source_;
  std::string buf_;
  size_t begin_ = 0;
  int64_t line_no_ = 0;
  bool eof_ = false;
};

}  // namespace moetrain::data
