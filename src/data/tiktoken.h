// tiktoken rank files (cl100k_base.tiktoken, o200k_base.tiktoken, Kimi's
// tiktoken.model) read into a BpeSpec for the engine (data/bpe.h).
//
// A rank file holds one token per line: its bytes in base64, a space, its rank
// (= its id). It does not say how text is split nor which special tokens
// exist; a small JSON, the description, does (docs/training.md#tokenizers):
//
//   {
//     "tiktoken": "cl100k_base.tiktoken",  // the rank file, relative to this file
//     "pattern": "'(?i:[sdmt]|ll|ve|re)|...",  // tiktoken's pat_str
//     "special_tokens": {"<|endoftext|>": 100257},
//     "document_prefix": [],                // special tokens before each document
//     "document_suffix": ["<|endoftext|>"],  // ... and after it
//     "vocab_size": 100277                  // optional: ids up to here (reserved ones)
//   }
//
// Give make_tokenizer either the description (it names the rank file in
// "tiktoken") or the rank file, with the description beside it as
// <rank file>.json ("tiktoken" then optional). Encoding equals tiktoken's
// Encoding(pat_str=pattern, mergeable_ranks, special_tokens).encode(text,
// allowed_special="all"): special tokens in the text are their ids, the text
// between them is cut into the pattern's matches (text no match covers is
// dropped, as tiktoken does), and each piece is a token if it is one, else the
// BPE by ranks. Documents with neither prefix nor suffix get "<|endoftext|>"
// before each when it is a special token.
//
// The settings can also come from the command line (prepare --tiktoken-pattern,
// --special-token, --document-prefix, --document-suffix): TiktokenSettings.
// With no description beside the rank file they are the whole description;
// with one, they must agree with it (a pattern, or an id for the same token,
// that differs is an Error naming the option and the file) and add to it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/bpe.h"

namespace moetrain::data {

// A description's fields given on the command line (prepare's options).
struct TiktokenSettings {
  std::string pattern;  // a preset name (tiktoken_pattern_preset) or a pattern; "" for none
  std::vector<std::pair<std::string, int64_t>> special_tokens;  // --special-token NAME=ID, in order
  std::vector<std::string> document_prefix, document_suffix;    // special token names
  bool empty() const {
    return pattern.empty() && special_tokens.empty() && document_prefix.empty() && document_suffix.empty();
  }
};

// The split pattern of a named preset, or nullptr: "llama3" (Llama 3's
// tokenizer.json; cl100k's pattern without possessive quantifiers), "o200k"
// (tiktoken's o200k_base), "kimi" (Kimi K2's tokenization_kimi.py).
const std::string* tiktoken_pattern_preset(std::string_view name);
// The preset names, comma separated, for messages and --help.
std::string tiktoken_pattern_preset_names();

// "NAME=ID" (split at the last '=') of --special-token; Error naming the option.
std::pair<std::string, int64_t> parse_special_token_option(const std::string& text);

// The rank file `rank_path` (content `rank_text`), described by the JSON file `description_path`.
// `settings` add to (and must agree with) the description; with settings, a
// missing description is no error (the settings are then all there is).
BpeSpec read_tiktoken(const std::string& rank_path, const std::string& rank_text, const std::string& description_path,
                      const TiktokenSettings& settings = {});
// The description `j` (parsed from `path`), which names the rank file in "tiktoken".
BpeSpec read_tiktoken_description(const std::string& path, const nlohmann::json& j,
                                  const TiktokenSettings& settings = {});

}  // namespace moetrain::data
