// The tokenizer files of a model export (moetrain export, docs/export.md#tokenizer-files):
// what transformers' AutoTokenizer.from_pretrained(DIR) loads and encodes with,
// id for id, as moetrain's tokenizer `data.tokenizer` does:
//
//   tokenizer.json         a tokenizer.json run: the file itself, byte for byte;
//                          gpt2: built from encoder.json and vocab.bpe (HF's GPT-2:
//                          ByteLevel pre-tokenizer with GPT-2's regex);
//                          a tiktoken rank file: vocab = the ranks, merges = every
//                          split of a token into two tokens ordered by the token's
//                          rank, ignore_merges, the pattern as a Split that keeps
//                          its matches only (Removed, invert: tiktoken drops text no
//                          match covers), the special tokens as added tokens;
//                          byte: 256 byte-alphabet tokens, no merges.
//                          Generated files carry a TemplateProcessing post-processor
//                          with the tokens prepare puts around each document
//                          (GPT-2: <|endoftext|> before it), so encode with
//                          add_special_tokens=True gives what prepare writes.
//   tokenizer_config.json  tokenizer_class PreTrainedTokenizerFast; bos_token the
//                          first token before a document, eos_token the last one
//                          after it (else "<|endoftext|>", "<|end_of_text|>" or
//                          "</s>" when an added token, else the end-of-text token);
//                          clean_up_tokenization_spaces false (decode gives the
//                          text back). A tokenizer file with a tokenizer_config.json
//                          (or chat_template.jinja) beside it, the Hugging Face
//                          layout, gives its chat_template and the bos_token /
//                          eos_token it declares (which must be tokens of the
//                          tokenizer; an Error naming the file and field otherwise).
//
// Where they differ: moetrain's gpt2 reads a literal "<|endoftext|>" in text as
// ordinary text (tiktoken's encode_ordinary); the export, like GPT-2 on the Hub,
// reads it as the token 50256. The byte tokenizer takes any bytes; transformers
// takes text (well-formed UTF-8).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moetrain::data {

struct HfTokenizerFile {
  std::string name;  // "tokenizer.json", "tokenizer_config.json"
  std::string text;
};

// The files for the tokenizer `name` (data.tokenizer; "gpt2" reads `tokenizer_dir`).
// Throws moetrain::Error naming the file when the tokenizer cannot be read.
std::vector<HfTokenizerFile> hf_tokenizer_files(std::string_view name, const std::string& tokenizer_dir);

}  // namespace moetrain::data
