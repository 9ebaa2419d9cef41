// Tokenizer files end to end: `prepare --tokenizer <tokenizer.json | rank file>`
// writes the tokenizer's ids with its document tokens around each file, a
// tokenizer file the engine cannot reproduce exits 2 naming the file and
// field, and `train` with data.tokenizer set to a file checks model.vocab_size
// against it and decodes its samples with it. Fixtures: tests/data/bpe/.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>

#include <string>
#include <vector>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "testing.h"

using moetrain::testing::CommandOutput;
using moetrain::testing::run_moetrain;
using moetrain::testing::TempDir;
using moetrain::testing::write_bytes;
using std::string;

namespace {

const string kFixtures = string(MOETRAIN_SOURCE_DIR) + "/tests/data/bpe";

std::vector<uint32_t> expected_stream(const moetrain::data::Tokenizer& tok, const std::vector<string>& docs) {
  std::vector<uint32_t> out;
  const moetrain::data::DocumentTokens around = tok.document_tokens();
  for (const string& d : docs) {
    out.insert(out.end(), around.prefix.begin(), around.prefix.end());
    for (int32_t id : tok.encode(d)) out.push_back(static_cast<uint32_t>(id));
    out.insert(out.end(), around.suffix.begin(), around.suffix.end());
  }
  return out;
}

}  // namespace

TEST_CASE("tokenizer file cli: prepare with a tokenizer.json and a tiktoken rank file", "[cli][data]") {
  TempDir tmp;
  const std::vector<string> docs = {"Hello world! It's café\xCC\x81 time.\n\n  \xE4\xB8\xAD\xE6\x96\x87 12345<|end_of_text|>x",
                                    "Second document.\r\nWith \xF0\x9F\xA4\x96 emoji and   spaces.\n"};
  write_bytes(tmp.path() + "/a.txt", docs[0]);
  write_bytes(tmp.path() + "/b.txt", docs[1]);
  for (const char* file : {"llama3_nfc.tokenizer.json", "llama3.tiktoken"}) {
    INFO(file);
    const string tok_path = kFixtures + "/" + file, out = tmp.path() + "/out_" + file;
    const CommandOutput r = run_moetrain("prepare " + tmp.path() + "/a.txt " + tmp.path() + "/b.txt --out " + out +
                                         " --tokenizer " + tok_path + " --val-tokens 0");
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("(" + tok_path + ")"));
    const auto tok = moetrain::data::make_tokenizer(tok_path, "");
    const std::vector<uint32_t> want = expected_stream(*tok, docs);
    CHECK(want.front() == 700);  // <|begin_of_text|> before each document
    CHECK(moetrain::data::read_shard(out + "/train_000000.bin") == want);
    CHECK(moetrain::data::TokenShard(out + "/train_000000.bin").width() == moetrain::data::TokenWidth::u16);
  }
}

TEST_CASE("tokenizer file cli: a tokenizer file that cannot be reproduced exits 2 naming file and field",
          "[cli][data]") {
  TempDir tmp;
  write_bytes(tmp.path() + "/a.txt", "text\n");
  string json = moetrain::testing::read_bytes(kFixtures + "/llama3_nfc.tokenizer.json");
  const string from = "\"normalizer\": {\"type\": \"NFC\"}";
  REQUIRE(json.find(from) != string::npos);
  json.replace(json.find(from), from.size(), "\"normalizer\": {\"type\": \"NFKC\"}");
  write_bytes(tmp.path() + "/tok.json", json);
  const CommandOutput r = run_moetrain("prepare " + tmp.path() + "/a.txt --out " + tmp.path() + "/out --tokenizer " +
                                       tmp.path() + "/tok.json --val-tokens 0");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains(tmp.path() + "/tok.json: normalizer.type is \"NFKC\""));
  CHECK_FALSE(std::filesystem::exists(tmp.path() + "/out/train_000000.bin"));
  const CommandOutput unknown = run_moetrain("prepare " + tmp.path() + "/a.txt --out " + tmp.path() +
                                             "/out --tokenizer llama");
  CHECK(unknown.code == 2);
  CHECK_THAT(unknown.output, Catch::Contains("unknown tokenizer \"llama\""));
}

TEST_CASE("tokenizer file cli: train checks model.vocab_size against the file and samples with it", "[cli][data]") {
  TempDir tmp;
  const string tok_path = kFixtures + "/llama3_nfc.tokenizer.json";
  write_bytes(tmp.path() + "/a.txt", moetrain::testing::read_bytes(string(MOETRAIN_SOURCE_DIR) +
                                                                   "/data/tinyshakespeare.txt").substr(0, 20000));
  const CommandOutput p = run_moetrain("prepare " + tmp.path() + "/a.txt --out " + tmp.path() +
                                       "/data --tokenizer " + tok_path + " --val-tokens 256");
  INFO(p.output);
  REQUIRE(p.code == 0);
  const string args = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/gpt2-shakespeare.yaml "
                      "--set model.n_layer=1 --set model.n_head=2 --set model.d_model=16 --set model.n_ctx=32 "
                      "--set data.tokenizer=" + tok_path + " --set data.train=" + tmp.path() + "/data/train_*.bin "
                      "--set data.val= --set train.batch_size=2 --set train.seq_len=16 --set train.max_steps=2 "
                      "--set train.warmup_steps=1 --set train.eval_every=0 --set train.threads=1 "
                      "--set train.log_every=1 --set train.sample_every=2 --set train.sample_tokens=8 "
                      "--set run.dir=" + tmp.path() + "/run";
  const CommandOutput small = run_moetrain(args + " --set model.vocab_size=512");
  CHECK(small.code == 2);
  CHECK_THAT(small.output, Catch::Contains("model.vocab_size") && Catch::Contains("704"));
  const CommandOutput ok = run_moetrain(args + " --set model.vocab_size=704 --set train.sample_prompt=Hello");
  INFO(ok.output);
  REQUIRE(ok.code == 0);
  CHECK_THAT(ok.output, Catch::Contains("sample at step 2:\nHello"));
}

TEST_CASE("tokenizer file cli: JSONL on stdin with -", "[cli][data]") {
  TempDir tmp;
  write_bytes(tmp.path() + "/c.jsonl", "{\"text\": \"first document\"}\n\n{\"text\": \"second, \\u00e9\"}\n");
  const string tok_path = kFixtures + "/llama3_nfc.tokenizer.json";
  const CommandOutput r = moetrain::testing::capture_command(
      "cat " + tmp.path() + "/c.jsonl | " + string(MOETRAIN_BINARY_DIR) + "/moetrain prepare - --out " + tmp.path() +
      "/out --tokenizer " + tok_path + " --val-tokens 0");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const auto tok = moetrain::data::make_tokenizer(tok_path, "");
  CHECK(moetrain::data::read_shard(tmp.path() + "/out/train_000000.bin") ==
        expected_stream(*tok, {"first document", "second, \xC3\xA9"}));
  const CommandOutput bad = moetrain::testing::capture_command(
      "printf '{\"text\": 1}\\n' | " + string(MOETRAIN_BINARY_DIR) + "/moetrain prepare - --out " + tmp.path() +
      "/bad --tokenizer " + tok_path);
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("<stdin>:1: no string field \"text\""));
}

TEST_CASE("tokenizer file cli: a K3 config trains on a tokenizer of more than 65,536 tokens", "[cli][data]") {
  // The tokenizer is built by tests/reference/bpe_reference.py (HF tokenizers), not committed.
  const char* env = std::getenv("MOETRAIN_TOKENIZERS_PYTHON");
  const string py = env != nullptr && *env != '\0' ? env : "python3";
  if (moetrain::testing::capture_command(py + " -c 'import tokenizers, tiktoken'").code != 0) {
    WARN("skipped: " << py << " cannot import tokenizers and tiktoken (set MOETRAIN_TOKENIZERS_PYTHON to a python "
                              "that can)");
    return;
  }
  TempDir tmp;
  const CommandOutput made = moetrain::testing::capture_command(
      py + " " + string(MOETRAIN_SOURCE_DIR) + "/tests/reference/bpe_reference.py big " + tmp.path() + "/tok");
  INFO(made.output);
  REQUIRE(made.code == 0);
  const string tok_path = tmp.path() + "/tok/big.tokenizer.json";
  const CommandOutput p = run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " +
                                       tmp.path() + "/data --tokenizer " + tok_path + " --val-tokens 4096");
  INFO(p.output);
  REQUIRE(p.code == 0);
  CHECK(moetrain::data::TokenShard(tmp.path() + "/data/train_000000.bin").width() == moetrain::data::TokenWidth::u32);
  const int64_t vocab = moetrain::data::make_tokenizer(tok_path, "")->vocab_size();
  REQUIRE(vocab > 65536);
  const CommandOutput t = run_moetrain(
      "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set model.vocab_size=" +
      std::to_string(vocab) + " --set model.vocab_pad_multiple=64 --set data.tokenizer=" + tok_path +
      " --set data.train=" + tmp.path() + "/data/train_*.bin --set data.val=" + tmp.path() +
      "/data/val_*.bin --set train.max_steps=2 --set train.warmup_steps=1 --set train.eval_every=2 "
      "--set train.eval_batches=1 --set train.batch_size=2 --set train.seq_len=32 --set train.threads=2 "
      "--set train.sample_every=2 --set train.sample_tokens=4 --set train.sample_prompt=ROMEO "
      "--set run.dir=" + tmp.path() + "/run");
  INFO(t.output);
  REQUIRE(t.code == 0);
  CHECK_THAT(t.output, Catch::Contains("val loss") && Catch::Contains("sample at step 2:\nROMEO"));
}
