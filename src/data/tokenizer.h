// Tokenizers: text (bytes) to token ids and back.
//
// ByteTokenizer   one id per byte (256 ids), no end-of-text token; any bytes.
// BpeTokenizer    (data/bpe.h) a Hugging Face tokenizer.json of the byte-level
//                 BPE family or a tiktoken rank file (make_tokenizer with a path).
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
// Thread safety: all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace moetrain::data {

size_t find_split_point(std::string_view text, size_t limit);  // below

class BpeModel;    // data/bpe.h
struct TiktokenSettings;  // data/tiktoken.h
class SplitRegex;  // data/bpe.h

// The ids `prepare` puts around every document: the tokenizer's way of
// separating documents (GPT-2: <|endoftext|> before each; a tokenizer.json:
// its post-processor's template, e.g. Llama 3's <|begin_of_text|> before each).
struct DocumentTokens {
  std::vector<int32_t> prefix, suffix;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;  // "gpt2", "byte", or the tokenizer file's path
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Throws moetrain::Error naming the position of an id outside [0, vocab_size).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int32_t vocab_size() const = 0;
  // The end-of-text token that separates documents, if the vocabulary has one.
  virtual std::optional<int32_t> eot_token() const = 0;
  // Default: the end-of-text token before each document, if there is one.
  virtual DocumentTokens document_tokens() const {
    DocumentTokens d;
    if (auto eot = eot_token()) d.prefix.push_back(*eot);
    return d;
  }
  // Whether encode() takes only well-formed UTF-8.
  virtual bool needs_utf8() const = 0;
  // Whether prepare may read a document in parts cut at find_cut; otherwise it
  // encodes each document whole.
  virtual bool encodes_in_chunks() const = 0;
  // A cut in `text` (the start of a document, or of its rest after an earlier
  // cut; more text may follow) such that encoding text[0, cut) and then the
  // rest from the cut on gives the ids of the whole, also when each part is
  // repaired by replace_invalid_utf8 first (`repair`, data/utf8.h); 0 when
  // `text` has none (read more). Default: find_split_point (GPT-2, bytes).
  virtual size_t find_cut(std::string_view text, bool repair) const {
    return encodes_in_chunks() ? find_split_point(text, text.size()) : 0;
  }
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
  bool needs_utf8() const override { return false; }
  bool encodes_in_chunks() const override { return true; }
};

// GPT-2 BPE from `dir`/encoder.json (token string -> id) and `dir`/vocab.bpe
// (merge rules in rank order). Pre-tokenisation is GPT-2's regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// with \s, \p{L}, \p{N} as in Python's `regex` module (Unicode 15.0; see
// bpe.cpp), then per piece the merge loop of encoder.py's bpe(), which the BPE
// engine (data/bpe.h, HF's merge order) equals on GPT-2's merge table.
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
  bool needs_utf8() const override { return true; }
  bool encodes_in_chunks() const override { return true; }

  // The pre-tokenised pieces of `text` (valid UTF-8), in order; they tile the text.
  std::vector<std::string_view> split(std::string_view text) const;
  // The BPE of one piece (encoder.py's bpe() followed by the encoder lookup).
  std::vector<int32_t> bpe(std::string_view piece) const;

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  std::vector<std::string> id_to_bytes_;       // token id -> its bytes
  std::optional<int32_t> eot_;                 // "<|endoftext|>"
  std::unique_ptr<BpeModel> model_;            // the merge table (data/bpe.h)
  std::unique_ptr<SplitRegex> regex_;          // GPT-2's pattern
};

// "gpt2" (files in `tokenizer_dir`), "byte" (tokenizer_dir unused), or the path
// of a tokenizer file (anything with a '/' or a '.'): a Hugging Face
// tokenizer.json (data/tokenizer_json.h), a tiktoken rank file with its
// description beside it, or that description (data/tiktoken.h). The choice of
// data.tokenizer and prepare --tokenizer.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name, const std::string& tokenizer_dir);
// The same with a tiktoken description's fields from the command line (prepare
// --tiktoken-pattern, --special-token, ...): `name` must then be a tiktoken rank
// file or description, else an Error naming the options.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name, const std::string& tokenizer_dir,
                                          const TiktokenSettings& tiktoken);
// The tokenizer file at `path`, as above; errors name the file and the field.
std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path);
std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path, const TiktokenSettings& tiktoken);

// A byte position at which `text` can be cut so that the GPT-2 pieces of the
// two halves are exactly the pieces of the whole: the last '\n' (before
// `limit`) that follows a printable ASCII character (0x21..0x7E). Neither
// piece can span such a cut and no match looks across it. Returns 0 when
// there is none. Lets `prepare` tokenize a file in chunks.
size_t find_split_point(std::string_view text, size_t limit);

}  // namespace moetrain::data
