// prepare's inputs at scale (data/corpus.h): JSONL with a text field, gzip and
// zstd, directories and globs, "-" on stdin; a bad line names file and line;
// the shards are the same bytes for any number of threads.
#include <catch2/catch.hpp>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/corpus.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;
namespace fs = std::filesystem;

namespace {

PrepareOptions corpus_options(std::vector<std::string> inputs, std::string out) {
  PrepareOptions o;
  o.inputs = std::move(inputs);
  o.out_dir = std::move(out);
  o.tokenizer_dir = kGpt2Dir;
  o.val_tokens = 0;
  o.progress.mode = ProgressOptions::Mode::off;
  return o;
}

// Documents of the shipped corpus: its paragraphs (blank-line separated).
std::vector<std::string> corpus_documents(size_t n) {
  const std::string text = read_bytes(kShakespeare);
  std::vector<std::string> docs;
  for (size_t at = 0; docs.size() < n && at < text.size();) {
    size_t end = text.find("\n\n", at);
    if (end == std::string::npos) end = text.size();
    docs.push_back(text.substr(at, end - at));
    at = end + 2;
  }
  return docs;
}

std::string jsonl_of(const std::vector<std::string>& docs, const std::string& field = "text") {
  std::string out;
  for (size_t i = 0; i < docs.size(); ++i) {
    out += nlohmann::json{{"id", i}, {field, docs[i]}}.dump() + "\n";
    if (i % 7 == 3) out += "\n";  // blank lines hold no document
  }
  return out;
}

std::vector<uint32_t> stream_of(const Tokenizer& tok, const std::vector<std::string>& docs) {
  std::vector<uint32_t> out;
  const DocumentTokens around = tok.document_tokens();
  for (const std::string& d : docs) {
    out.insert(out.end(), around.prefix.begin(), around.prefix.end());
    for (int32_t id : tok.encode(d)) out.push_back(static_cast<uint32_t>(id));
    out.insert(out.end(), around.suffix.begin(), around.suffix.end());
  }
  return out;
}

}  // namespace

TEST_CASE("corpus: JSONL documents, one per line, between the tokenizer's document tokens", "[data][prepare]") {
  TempDir dir;
  const std::vector<std::string> docs = corpus_documents(200);
  write_bytes(dir / "c.jsonl", jsonl_of(docs, "content"));
  for (const std::string tok : {std::string("gpt2"), kSourceDir + "/tests/data/bpe/llama3_nfc.tokenizer.json"}) {
    INFO(tok);
    const std::string out = dir / ("out" + std::to_string(tok.size()));
    PrepareOptions o = corpus_options({dir / "c.jsonl"}, out);
    o.tokenizer = tok;
    o.text_field = "content";
    const PrepareSummary s = prepare_shards(o);
    CHECK(s.num_documents == static_cast<int64_t>(docs.size()));
    CHECK(read_shard(out + "/train_000000.bin") == stream_of(*make_tokenizer(tok, kGpt2Dir), docs));
  }
}

TEST_CASE("corpus: gzip and zstd inputs give the shards of the plain files", "[data][prepare]") {
  TempDir dir;
  const std::vector<std::string> docs = corpus_documents(300);
  write_bytes(dir / "a.jsonl", jsonl_of(docs));
  write_bytes(dir / "b.txt", read_bytes(kShakespeare).substr(0, 300000));
  REQUIRE(run_command("cd " + shell_quote(dir.path()) + " && gzip -k a.jsonl b.txt && zstd -q -k a.jsonl b.txt") == 0);
  PrepareOptions plain = corpus_options({dir / "a.jsonl", dir / "b.txt"}, dir / "plain");
  plain.chunk_bytes = 4096;
  prepare_shards(plain);
  const std::vector<uint32_t> want = read_shard(dir / "plain/train_000000.bin");
  for (const char* ext : {".gz", ".zst"}) {
    INFO(ext);
    const std::string out = dir / (std::string("out") + ext);
    PrepareOptions o = corpus_options({dir / ("a.jsonl" + std::string(ext)), dir / ("b.txt" + std::string(ext))}, out);
    o.chunk_bytes = 4096;
    prepare_shards(o);
    CHECK(read_shard(out + "/train_000000.bin") == want);
  }
  // A damaged compressed file names itself.
  write_bytes(dir / "bad.txt.zst", "not zstd at all");
  CHECK_THROWS_WITH(prepare_shards(corpus_options({dir / "bad.txt.zst"}, dir / "bad")),
                    Catch::Contains(dir / "bad.txt.zst") && Catch::Contains("zstd"));
  write_bytes(dir / "bad.txt.gz", std::string("\x1f\x8b\x08\x00garbage", 12));
  CHECK_THROWS_WITH(prepare_shards(corpus_options({dir / "bad.txt.gz"}, dir / "bad")),
                    Catch::Contains(dir / "bad.txt.gz"));
  write_bytes(dir / "plain.txt.gz", "plain text, not gzip\n");
  CHECK_THROWS_WITH(prepare_shards(corpus_options({dir / "plain.txt.gz"}, dir / "bad")),
                    Catch::Contains(dir / "plain.txt.gz") && Catch::Contains("not a gzip file"));
  CHECK_FALSE(fs::exists(dir / "bad/train_000000.bin"));
}

TEST_CASE("corpus: directories and globs expand to their inputs in path order", "[data][prepare]") {
  TempDir dir;
  fs::create_directories(dir / "d/sub");
  write_bytes(dir / "d/b.txt", "b");
  write_bytes(dir / "d/a.jsonl", "{\"text\": \"a\"}\n");
  write_bytes(dir / "d/sub/c.txt.gz", "");
  write_bytes(dir / "d/notes.md", "skipped");
  std::vector<std::string> got;
  for (const CorpusInput& in : expand_corpus_inputs({dir / "d"})) got.push_back(in.path);
  CHECK(got == std::vector<std::string>{dir / "d/a.jsonl", dir / "d/b.txt", dir / "d/sub/c.txt.gz"});
  const std::vector<CorpusInput> globbed = expand_corpus_inputs({dir / "d/*.txt", dir / "d/*.jsonl", "-"});
  REQUIRE(globbed.size() == 3);
  CHECK(globbed[0].format == CorpusFormat::text);
  CHECK(globbed[1].format == CorpusFormat::jsonl);
  CHECK(globbed[2].is_stdin());
  CHECK(expand_corpus_inputs({dir / "d/sub/c.txt.gz"})[0].compression == CorpusCompression::gzip);
  CHECK_THROWS_WITH(expand_corpus_inputs({dir / "d/*.parquet"}), Catch::Contains("*.parquet") &&
                                                                   Catch::Contains("matches no file"));
  CHECK_THROWS_WITH(expand_corpus_inputs({"-", "-"}), Catch::Contains("twice"));
}

TEST_CASE("corpus: a bad JSONL line names the file and the line; nothing is written", "[data][prepare][errors]") {
  TempDir dir;
  const std::string good = "{\"text\": \"fine\"}\n";
  struct Case {
    std::string line, needle;
  };
  for (const Case& c : {Case{"{\"text\": \"unterminated}", "not a JSON line"},
                        Case{"{\"body\": \"x\"}", "no string field \"text\""},
                        Case{"[1, 2]", "JSON object"},
                        Case{"{\"text\": 5}", "no string field"},
                        Case{"{\"text\": \"bad \xC0\xAF utf-8\"}", "not a JSON line"}}) {
    INFO(c.line);
    write_bytes(dir / "c.jsonl", good + good + c.line + "\n" + good);
    CHECK_THROWS_WITH(prepare_shards(corpus_options({dir / "c.jsonl"}, dir / "out")),
                      Catch::Contains(dir / "c.jsonl:3:") && Catch::Contains(c.needle));
    CHECK((!fs::exists(dir / "out") || !fs::exists(dir / "out/train_000000.bin")));
  }
  // --invalid-utf8 replace repairs a line before it is parsed.
  write_bytes(dir / "c.jsonl", "{\"text\": \"bad \xC0 utf-8\"}\n");
  PrepareOptions o = corpus_options({dir / "c.jsonl"}, dir / "fixed");
  o.replace_invalid_utf8 = true;
  CHECK(prepare_shards(o).num_documents == 1);
}

TEST_CASE("corpus: the shards are the same bytes for 1, 2 and 5 threads", "[data][prepare]") {
  TempDir dir;
  const std::vector<std::string> docs = corpus_documents(400);
  write_bytes(dir / "a.jsonl", jsonl_of(docs));
  write_bytes(dir / "b.txt", read_bytes(kShakespeare).substr(0, 200000));
  for (const std::string tok : {std::string("gpt2"), kSourceDir + "/tests/data/bpe/llama3.tiktoken"}) {
    std::string first;
    for (int threads : {1, 2, 5}) {
      INFO(tok << ", threads " << threads);
      const std::string out = dir / ("t" + std::to_string(threads) + std::to_string(tok.size()));
      PrepareOptions o = corpus_options({dir / "a.jsonl", dir / "b.txt"}, out);
      o.tokenizer = tok;
      o.threads = threads;
      o.chunk_bytes = 2048;  // many small batches
      o.shard_tokens = 50000;
      const PrepareSummary s = prepare_shards(o);
      CHECK(s.num_documents == static_cast<int64_t>(docs.size()) + 1);
      std::string bytes;
      for (const PreparedShard& shard : s.shards) bytes += read_bytes(shard.path);
      if (first.empty()) first = bytes;
      CHECK(bytes == first);
    }
  }
}
