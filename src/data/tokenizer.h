// Tokenizers: text (bytes) to token ids and back.
//
// ByteTokenizer   one id per byte (256 ids), no end-of-text token; any bytes.
// Gpt2Tokenizer   OpenAI's GPT-2 byte-level BPE, token for token equal to
//                 encoder.py (github.com/openai/gpt-2, src/encoder.py) and to
//                 tiktoken's encode_ordinary: the text "<|endoftext|>" is
//                 ordinary text; the end-of-text id 50256 is only ever added
//                 by the caller (moetrain prepare puts it before each document).
//
// Conventions. encode() takes bytes; the GPT-2 tokenizer needs well-formed
// UTF-8 (encoder.py works on Python str) and throws moetrain::Error naming the
// byte offset of the first ill-formed byte otherwise — repair text first with
// replace_invalid_utf8 (data/utf8.h) if U+FFFD substitution is wanted.
// decode() returns the raw bytes of the tokens; decoding a prefix of the ids
// may end inside a UTF-8 character, and decode(a) + decode(b) == decode(a ++ b).
// decode(encode(x)) == x for every input encode accepts.
//
// Thread safety: all methods may be called concurrently; GPT-2 encode() calls
// share a per-word cache under a mutex, so they run one at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace moetrain::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;  // "gpt2", "byte"
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Throws moetrain::Error naming the position of an id outside [0, vocab_size).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int32_t vocab_size() const = 0;
  // The end-of-text token that separates documents, if the vocabulary has one.
  virtual std::optional<int32_t> eot_token() const = 0;
};

// Ids 0..255 are the bytes 0x00..0xff. No end-of-text token: 256 ids leave no
// room for one, and a byte-level model on one corpus (tiny shakespeare,
// nanoGPT's shakespeare_char) does not need document separators.
class ByteTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "byte"; }
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return 256; }
  std::optional<int32_t> eot_token() const override { return std::nullopt; }
};

// GPT-2 BPE from `dir`/encoder.json (token string -> id) and `dir`/vocab.bpe
// (merge rules in rank order). Pre-tokenisation is GPT-2's regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// with \s, \p{L}, \p{N} as in Python's `regex` module (Unicode 15.0; see
// tokenizer.cpp), then per piece the merge loop of encoder.py's bpe().
class Gpt2Tokenizer final : public Tokenizer {
 public:
  // Throws moetrain::Error naming the file when a file is missing or corrupt.
  explicit Gpt2Tokenizer(const std::string& dir);
  ~Gpt2Tokenizer() override;
  Gpt2Tokenizer(const Gpt2Tokenizer&) = delete;
  Gpt2Tokenizer& operator=(const Gpt2Tokenizer&) = delete;

  std::string name() const override { return "gpt2"; }
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_bytes_.size()); }
  std::optional<int32_t> eot_token() const override { return eot_; }

  // The pre-tokenised pieces of `text` (valid UTF-8), in order; they tile the text.
  std::vector<std::string_view> split(std::string_view text) const;
  // The BPE of one piece (encoder.py's bpe() followed by the encoder lookup).
  std::vector<int32_t> bpe(std::string_view piece) const;

 private:
  struct Merge {
    int32_t rank;    // line in vocab.bpe after the version line, from 0; lower merges first
    int32_t merged;  // id of the merged token
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<std::string> id_to_bytes_;                 // token id -> its bytes
  int32_t byte_to_id_[256] = {};                         // the single-byte tokens
  std::unordered_map<uint64_t, Merge> merges_;           // (left id << 32 | right id) -> merge
  std::optional<int32_t> eot_;                           // "<|endoftext|>"
  struct Regex;                                          // the compiled PCRE2 pattern
  std::unique_ptr<Regex> regex_;

  // Per-piece cache of bpe() results (encoder.py keeps one too). Cleared when
  // it reaches kMaxCacheEntries, which bounds memory on large corpora.
  static constexpr size_t kMaxCacheEntries = size_t{1} << 18;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

// "gpt2" (files in `tokenizer_dir`) or "byte" (tokenizer_dir unused).
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name, const std::string& tokenizer_dir);

// A byte position at which `text` can be cut so that the GPT-2 pieces of the
// two halves are exactly the pieces of the whole: the last '\n' (before
// `limit`) that follows a printable ASCII character (0x21..0x7E). Neither
// piece can span such a cut and no match looks across it. Returns 0 when
// there is none. Lets `prepare` tokenize a file in chunks.
size_t find_split_point(std::string_view text, size_t limit);

}  // namespace moetrain::data
