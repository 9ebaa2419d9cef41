// `moetrain prepare`: tokenize text files into llm.c token shards for training.
// The work is data::prepare_shards (src/data/prepare.h, which documents the
// document/EOT, val/train split and file conventions); this file parses the
// options and prints the summary. Progress goes to stderr, the summary to stdout.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "data/prepare.h"

namespace moetrain::cli {

void add_prepare_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand(
      "prepare",
      "Tokenize text and JSONL into token shards: the first --val-tokens tokens to val_000000.bin, the rest to "
      "train_NNNNNN.bin (llm.c format). A text file is one document, a JSONL line one; each goes between the "
      "tokenizer's document tokens (GPT-2: <|endoftext|> before each).");
  auto options = std::make_shared<data::PrepareOptions>();
  auto invalid_utf8 = std::make_shared<std::string>("error");
  cmd->add_option("inputs", options->inputs,
                  "Files, directories (their .txt / .jsonl files, recursively) or globs; .txt is one document, "
                  ".jsonl one per line; .gz and .zst are decompressed; - reads JSONL from stdin. UTF-8 unless "
                  "--tokenizer byte")
      ->required()
      ->default_str("");
  cmd->add_option("--text-field", options->text_field, "JSONL: the field that holds the document")
      ->capture_default_str();

  cmd->add_option("--out", options->out_dir, "Output directory (created if missing)")->required();
  cmd->add_option("--tokenizer", options->tokenizer,
                  "gpt2, byte, or the path of a Hugging Face tokenizer.json or a tiktoken rank file (its description "
                  "<file>.json beside it) or description (docs/training.md#tokenizers)")
      ->capture_default_str();
  auto special_tokens = std::make_shared<std::vector<std::string>>();
  cmd->add_option("--tiktoken-pattern", options->tiktoken.pattern,
                  "A tiktoken rank file's split pattern: a preset (" + data::tiktoken_pattern_preset_names() +
                      ") or a regex (tiktoken's pat_str); with a description beside the file it must agree with it");
  cmd->add_option("--special-token", *special_tokens,
                  "A tiktoken rank file's special token NAME=ID (repeat for more); must agree with the description "
                  "beside the file, if any")
      ->take_all()
      ->allow_extra_args(false);
  cmd->add_option("--document-prefix", options->tiktoken.document_prefix,
                  "tiktoken: the special tokens (names) before each document (repeat for more)")
      ->allow_extra_args(false);
  cmd->add_option("--document-suffix", options->tiktoken.document_suffix,
                  "tiktoken: the special tokens (names) after each document (repeat for more)")
      ->allow_extra_args(false);
  cmd->add_option("--tokenizer-dir", options->tokenizer_dir, "Directory with encoder.json and vocab.bpe (gpt2)")
      ->capture_default_str();
  cmd->add_option("--val-tokens", options->val_tokens, "Tokens for val_000000.bin (0: no val shard)")
      ->capture_default_str();
  cmd->add_option("--shard-tokens", options->shard_tokens, "Tokens per train shard")->capture_default_str();
  cmd->add_option("--name", options->name, "File name prefix: NAME_train_000000.bin");
  cmd->add_option("--invalid-utf8", *invalid_utf8,
                  "Ill-formed UTF-8 in an input: error (name file, offset, line) or replace (U+FFFD, as Python's "
                  "errors=\"replace\")")
      ->check(CLI::IsMember({"error", "replace"}))
      ->capture_default_str();
  cmd->add_flag("--overwrite", options->overwrite, "Replace shards of the same name already in --out");
  cmd->add_option("--chunk-bytes", options->chunk_bytes,
                  "Read and tokenize text files in parts of about this many bytes (memory: about 2 x threads x this); "
                  "the shards are the same for any value")
      ->check(CLI::Range(size_t{1}, size_t{1} << 30))
      ->capture_default_str();

  commands.push_back({cmd, [options, invalid_utf8, special_tokens] {
    options->replace_invalid_utf8 = *invalid_utf8 == "replace";
    options->tiktoken.special_tokens.clear();
    for (const std::string& s : *special_tokens)
      options->tiktoken.special_tokens.push_back(data::parse_special_token_option(s));
    data::PrepareSummary s = data::prepare_shards(*options);
    fmt::print("prepared {} tokens ({}) from {} document(s), {} bytes, in {:.2f} s ({} tok/s)\n", s.num_tokens,
               s.tokenizer, s.num_documents, s.num_bytes, s.seconds,
               data::Progress::format_count(s.seconds > 0 ? static_cast<double>(s.num_tokens) / s.seconds : 0, true));
    if (s.num_replaced > 0)
      fmt::print("replaced {} ill-formed UTF-8 sequence(s) by U+FFFD\n", s.num_replaced);
    size_t width = 0;
    for (const data::PreparedShard& shard : s.shards) width = std::max(width, shard.path.size());
    for (const data::PreparedShard& shard : s.shards)
      fmt::print("  {:<{}}  {:>11} tokens\n", shard.path, width, shard.num_tokens);
    return 0;
  }});
}

}  // namespace moetrain::cli
