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
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

#include "data/bpe.h"

namespace moetrain::data {

// The rank file `rank_path` (content `rank_text`), described by the JSON file `description_path`.
BpeSpec read_tiktoken(const std::string& rank_path, const std::string& rank_text, const std::string& description_path);
// The description `j` (parsed from `path`), which names the rank file in "tiktoken".
BpeSpec read_tiktoken_description(const std::string& path, const nlohmann::json& j);

}  // namespace moetrain::data
