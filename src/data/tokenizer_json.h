// Hugging Face tokenizer.json files of the byte-level BPE family (GPT-2,
// Llama 3, Qwen2, DeepSeek) read into a BpeSpec for the engine (data/bpe.h).
//
// Read, and reproduced exactly:
//   model          type BPE: vocab, merges ("a b" strings or [a, b] pairs),
//                  ignore_merges; unk_token is allowed (every byte is a token,
//                  so it never applies)
//   normalizer     null, NFC, or a Sequence of NFC
//   pre_tokenizer  ByteLevel (add_prefix_space, use_regex), Split (Regex or
//                  String pattern; Isolated, Removed, MergedWithPrevious,
//                  MergedWithNext, Contiguous; invert), or a Sequence of them
//                  whose last step is the one ByteLevel
//   added_tokens   matched before BPE (normalized ones after NFC)
//   post_processor null, ByteLevel, TemplateProcessing (its "single" template's
//                  special tokens around $A: the ids prepare puts around each
//                  document), or a Sequence of them
//   decoder        ByteLevel, or a Sequence of ByteLevel
// Anything else (another model type, normalizer, pre-tokenizer, post-processor
// or decoder; byte_fallback, dropout, a continuing_subword_prefix or
// end_of_word_suffix, added tokens with lstrip, rstrip or single_word,
// truncation or padding) is refused: an Error naming the file and the JSON
// field, e.g. "tok.json: normalizer.type is \"Lowercase\"; ...".
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

#include "data/bpe.h"

namespace moetrain::data {

// `j` is the parsed content of `path`.
BpeSpec read_tokenizer_json(const std::string& path, const nlohmann::json& j);

}  // namespace moetrain::data
