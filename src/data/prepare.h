// Text files to token shards: what `moetrain prepare` does (src/cli/prepare.cpp).
//
// Inputs (data/corpus.h): files, directories, globs and "-" (JSONL on stdin);
// .txt and .jsonl, each maybe .gz or .zst. A text file is one document, a JSONL
// line (its text_field) is one; a bad line is an Error naming file and line.
// Documents are encoded in parallel batches of about 2 x threads x chunk_bytes
// and written in input order: the shards are the same for any thread count.
//
// Documents. Each document is placed between the tokenizer's
// document tokens (Tokenizer::document_tokens): GPT-2's end-of-text token
// (<|endoftext|> = 50256) precedes every document, as in llm.c's data scripts,
// so the stream starts with it and one separates every two files; a
// tokenizer.json puts its post-processor's template around each (Llama 3:
// <|begin_of_text|> before); a tiktoken description names them. The byte
// tokenizer has none: files are concatenated as they are.
//
// Split (as llm.c): the first val_tokens tokens of the stream go to
// val_000000.bin, the rest to train_000000.bin, train_000001.bin, ... of
// shard_tokens tokens each (the last one shorter). val_tokens = 0 writes no
// val shard. With a name prefix P the files are P_val_000000.bin, P_train_...
// Ids are uint16 when the tokenizer has at most 65536 of them, uint32 (llm.c's
// version-7 shards) otherwise: data/shard.h shard_width_for_vocab.
//
// Robustness. One prepare at a time writes into an out_dir: it holds a lock
// (flock on the directory); a second one is an Error naming it. Inputs are checked before anything is written (exist, regular
// files; for GPT-2 well-formed UTF-8 unless replace_invalid_utf8, see
// data/utf8.h; the same for every tokenizer file). Shards are written into a hidden staging directory inside
// out_dir (.prepare.tmp.<host>.<pid>) and renamed into place only after all of
// them are complete; a failure leaves out_dir as it was. The staging directories
// that runs killed on this host left in out_dir are removed at the start. A shard
// name taken by a directory, FIFO or device is an error before anything is
// written. Existing shards of the same prefix are an
// error unless overwrite, which then removes those not rewritten (so no stale
// train_000007.bin from a bigger earlier run stays behind).
//
// Files are read in chunks of about chunk_bytes cut at the tokenizer's find_cut
// (data/tokenizer.h), which gives the same tokens as encoding each file whole,
// in bounded memory: for GPT-2 and bytes after a '\n' that follows printable
// ASCII; for a tokenizer file (BpeTokenizer::find_cut, data/bpe.h) after a '\n'
// where every stage of its pipeline is checked to restart. A text with no such
// cut (no line breaks; a pattern that looks behind, a first pre-tokenizer step
// that merges pieces or adds a prefix space) is read whole: memory a few times
// the file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/progress.h"
#include "data/shard.h"
#include "data/tiktoken.h"

namespace moetrain::data {

struct PrepareOptions {
  std::vector<std::string> inputs;    // files, directories, globs, "-" (data/corpus.h)
  std::string out_dir;
  std::string tokenizer = "gpt2";     // "gpt2", "byte" or a tokenizer file (data/tokenizer.h make_tokenizer)
  std::string tokenizer_dir = "data/gpt2";
  TiktokenSettings tiktoken;          // a rank file's description from the command line (data/tiktoken.h)
  int64_t val_tokens = 32768;
  int64_t shard_tokens = 100'000'000;
  std::string name;                   // file name prefix; "" for none
  bool replace_invalid_utf8 = false;  // false: ill-formed UTF-8 is an error naming file, offset and line
  bool overwrite = false;
  size_t chunk_bytes = size_t{1} << 22;  // read and tokenize this much at a time (about; --chunk-bytes)
  std::string text_field = "text";       // JSONL: the field that holds the document
  int threads = 0;                       // tokenizing threads; 0: OpenMP's (moetrain --threads, else all cores)
  ProgressOptions progress;              // the progress report on stderr
};

struct PreparedShard {
  std::string path;
  int64_t num_tokens = 0;
};

struct PrepareSummary {
  std::string tokenizer;
  TokenWidth width = TokenWidth::u16;  // of the shards' ids: uint32 for a tokenizer of more than 65536 ids
  int64_t num_documents = 0;
  int64_t num_bytes = 0;       // of input text
  int64_t num_tokens = 0;      // written, end-of-text tokens included
  int64_t num_replaced = 0;    // ill-formed UTF-8 subparts replaced by U+FFFD
  std::vector<PreparedShard> shards;  // val first, then train in order
  double seconds = 0;
};

PrepareSummary prepare_shards(const PrepareOptions& options);

// The shard file name: "val_000000.bin", "P_train_000003.bin".
std::string shard_file_name(const std::string& prefix, const std::string& split, int64_t index);

}  // namespace moetrain::data
