// The byte-level BPE engine behind every BPE tokenizer moetrain reads: GPT-2's
// encoder.json + vocab.bpe (data/tokenizer.h), a Hugging Face tokenizer.json of
// the byte-level family (data/tokenizer_json.h) and a tiktoken rank file
// (data/tiktoken.h). The loaders turn their file into a BpeSpec; the engine
// encodes as the original does, step by step:
//
//   1. added tokens: matched in the raw text first (leftmost, then longest, as
//      HF's AddedVocabulary and tiktoken's special tokens), each one id; the
//      tokens marked `normalized` are matched after step 2 instead (HF);
//   2. normalizer: none or NFC (utf8proc), on the text between added tokens;
//   3. pre-tokenizer steps, each applied to every piece of the step before:
//      a regex Split (PCRE2, HF's five split behaviours and `invert`; the
//      pattern is rewritten so that \s, \p{L}, \p{N} mean what they mean in
//      Oniguruma / fancy-regex, see translate_split_pattern) and ByteLevel
//      (add_prefix_space, and with use_regex GPT-2's own split);
//   4. BPE of each piece over its bytes: the adjacent pair of lowest merge rank
//      is merged, the leftmost of equal ranks first, until no pair has a rank
//      (HF's Word::merge_all; tiktoken's byte_pair_merge is the same order once
//      its ranks are read as merges: every split of a token into two tokens is a
//      merge of the token's rank). With ignore_merges a piece that is itself a
//      token is that token (HF `ignore_merges`, tiktoken always).
//
// Text is UTF-8: ill-formed input is an Error naming the byte offset (HF and
// tiktoken take Python str, which cannot hold it); repair it with
// replace_invalid_utf8 (data/utf8.h), which prepare --invalid-utf8 replace does.
// decode() concatenates the tokens' bytes (HF's ByteLevel decoder; an added
// token decodes to its text; an id below vocab_size that no token has, such as
// a reserved id of a tiktoken description's vocab_size, to nothing, as HF's
// decode skips it).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data/tokenizer.h"

namespace moetrain::data {

// HF's SplitDelimiterBehavior: what happens to a match of a Split pattern.
enum class SplitBehavior { isolated, removed, merged_with_previous, merged_with_next, contiguous };

// A compiled PCRE2 pattern (UTF, UCP, JIT where available).
class SplitRegex {
 public:
  // `pattern` in PCRE2 syntax; `where` names its origin for the compile error ("file: pre_tokenizer.pattern").
  SplitRegex(const std::string& pattern, const std::string& where);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  // The matches in `text` (valid UTF-8) as [begin, end) byte offsets, left to
  // right, iterated as the onig crate's find_iter (which HF uses): after an
  // empty match the search resumes one character further on, and an empty
  // match right where the previous match ended is skipped.
  void find_matches(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;
  // The same for `text` that more text may follow: only the matches no later
  // byte can change (PCRE2's hard partial matching: the search stops at the first
  // attempt that reads the end of `text`).
  // Returns the offset before which no match starts other than those in `out`.
  size_t find_final_matches(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;
  // Whether a match may depend on text before the offset the search starts at
  // (a lookbehind, \b, \B, \A, ^ or \G): then matches found in a text cut at an
  // offset may differ from those found from that offset in the whole.
  bool looks_behind() const { return looks_behind_; }

 private:
  // find_matches (partial false: returns text.size()) and find_final_matches (true).
  size_t scan(std::string_view text, std::vector<std::pair<size_t, size_t>>& out, bool partial) const;

  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool looks_behind_ = true;
};

// `pattern` (Oniguruma / fancy-regex syntax, as in tokenizer.json or a tiktoken
// pattern) in PCRE2 syntax with the same meaning: \s, \S are Unicode's
// White_Space (PCRE2's \s also takes U+180E), \p{L}, \p{N} get the letters and
// digits of Unicode 15 that PCRE2 10.42 (Unicode 14) lacks. \S, \P{L} and \P{N}
// inside a [...] class and class intersection (&&) have no PCRE2 spelling: an
// Error naming `where`.
std::string translate_split_pattern(std::string_view pattern, const std::string& where);

// GPT-2's pre-tokenisation pattern (HF ByteLevel use_regex, encoder.py), in PCRE2 syntax.
const std::string& gpt2_split_pattern();

// A tokenizer file, read: what the engine needs to encode and decode.
struct BpeSpec {
  std::string name;    // what name() returns: "gpt2" or the file's path
  std::string source;  // the file, for messages
  // id -> bytes; ids with no token (holes) have has_token false and decode to nothing.
  std::vector<std::string> tokens;
  std::vector<bool> has_token;
  // The model's tokens that BPE can produce (the byte-alphabet ones of HF's vocab,
  // a rank file's tokens; not added tokens): what ignore_merges looks a piece up in.
  std::vector<bool> mergeable;
  // Merge rules: left id, right id, merged id, rank (HF: the line; tiktoken: the
  // merged token's rank, shared by every split of it).
  struct Merge {
    int32_t left, right, merged, rank;
  };
  std::vector<Merge> merges;
  bool ignore_merges = false;
  bool nfc = false;
  struct Step {
    enum class Kind { split, byte_level } kind = Kind::split;
    std::string pattern;  // PCRE2 syntax (split)
    std::string source_pattern;  // split: as the file writes it (Oniguruma / fancy-regex syntax)
    std::string where;    // "file: pre_tokenizer.pretokenizers[0]"
    SplitBehavior behavior = SplitBehavior::isolated;
    bool invert = false;
    bool add_prefix_space = false;  // byte_level
    bool use_regex = false;         // byte_level: then GPT-2's split, isolated
  };
  std::vector<Step> steps;
  struct Added {
    std::string content;
    int32_t id = 0;
    bool special = false;
    bool normalized = false;
  };
  std::vector<Added> added;
  // Ids around every document (prepare): the post-processor's template, or
  // what the tiktoken description names; with neither, the end-of-text token before each.
  std::vector<int32_t> document_prefix, document_suffix;
  std::optional<int32_t> eot;  // generate's empty prompt starts with it; a document separator
};

// The model half: byte strings to ids by merge rank.
class BpeModel {
 public:
  BpeModel() = default;
  // token_bytes: id -> bytes of the model's tokens (all 256 single bytes must
  // be among them); merges in rank order. Throws naming `source` for a merge
  // that appears twice.
  BpeModel(const std::vector<std::string>& token_bytes, const std::vector<bool>& mergeable,
           const std::vector<BpeSpec::Merge>& merges, bool ignore_merges, const std::string& source);

  // Appends the ids of one pre-tokenized piece (non-empty).
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

 private:
  struct Rule {
    int32_t rank, merged;
  };
  int32_t byte_to_id_[256] = {};
  std::unordered_map<uint64_t, Rule> merges_;           // (left << 32 | right) -> rule
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> whole_;  // ignore_merges: bytes -> id
  bool ignore_merges_ = false;
};

// The engine. encode() is the text's ids without the document's prefix/suffix
// (HF's encode(add_special_tokens=False), tiktoken's encode(allowed_special="all")).
class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeSpec spec);
  ~BpeTokenizer() override;

  std::string name() const override { return spec_.name; }
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(spec_.tokens.size()); }
  std::optional<int32_t> eot_token() const override { return spec_.eot; }
  DocumentTokens document_tokens() const override { return {spec_.document_prefix, spec_.document_suffix}; }
  bool needs_utf8() const override { return true; }
  // Whether find_cut can cut a document: the first pre-tokenizer step is a Split
  // (Isolated or Removed) or ByteLevel with its regex and no prefix space, and its
  // pattern looks at nothing before a match's start.
  bool encodes_in_chunks() const override { return chunkable_; }
  size_t find_cut(std::string_view text, bool repair) const override;

  // The pieces the pre-tokenizer cuts `text` into (no added tokens in it), after normalization.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  // The pre-tokenizer's pieces of normalized `text`; pieces given a prefix space live in `arena`.
  void split_pieces(std::string_view text, std::deque<std::string>& arena, std::vector<std::string_view>& pieces) const;
  void split_added(std::string_view text, bool normalized, std::vector<std::pair<std::string_view, int32_t>>& out) const;
  // Whether cutting the pre-tokenizer's input `text` (more may follow when `open`) at
  // `q` gives the whole's pieces, step `step` on (find_cut).
  bool cut_keeps_pieces(std::string_view text, size_t q, bool open, size_t step) const;

  BpeSpec spec_;
  BpeModel model_;
  std::vector<std::unique_ptr<SplitRegex>> regexes_;  // one per step (null for byte_level without regex)
  std::unique_ptr<SplitRegex> gpt2_regex_;
  // Added tokens by first byte, longest first: [raw, normalized].
  std::vector<int32_t> added_by_byte_[2][256];
  size_t longest_added_[2] = {0, 0};  // bytes of the longest added token: [raw, normalized]
  bool chunkable_ = false;
};

// GPT-2's bytes_to_unicode(): the character standing for each byte in a
// byte-level vocabulary ('!' for 0x21, 'Ġ' U+0120 for a space).
const std::array<uint32_t, 256>& byte_level_alphabet();
// The bytes a byte-level token string stands for; nullopt when a character is
// not in the alphabet.
std::optional<std::string> byte_level_decode(std::string_view token);
// The token string of `bytes` (UTF-8 of alphabet characters).
std::string byte_level_encode(std::string_view bytes);

// NFC of valid UTF-8 (utf8proc).
std::string nfc_normalize(std::string_view text);

}  // namespace moetrain::data
