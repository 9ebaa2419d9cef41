// prepare_shards and `moetrain prepare`: documents and end-of-text tokens, the
// val/train split, shard sizes and names, chunked reading against encoder.py,
// UTF-8 policy, overwrite rules, and the CLI's exit code and messages.
#include <catch2/catch.hpp>

#include <filesystem>

#include "core/error.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;
namespace fs = std::filesystem;

namespace {

PrepareOptions quiet(std::vector<std::string> inputs, std::string out) {
  PrepareOptions o;
  o.inputs = std::move(inputs);
  o.out_dir = std::move(out);
  o.tokenizer_dir = kGpt2Dir;
  o.progress.mode = ProgressOptions::Mode::off;
  return o;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<int32_t> as_ids(const std::vector<uint32_t>& tokens) { return {tokens.begin(), tokens.end()}; }

}  // namespace

TEST_CASE("prepare: tiny shakespeare is <|endoftext|> then encoder.py's ids, 32768 val", "[data][prepare]") {
  TempDir dir;
  PrepareOptions o = quiet({kShakespeare}, dir / "shakespeare");
  o.chunk_bytes = 65536;  // 18 chunks: chunked reading must not change a token
  const PrepareSummary s = prepare_shards(o);
  std::vector<int32_t> expected = {50256};
  const std::vector<int32_t> ref = reference_gpt2_ids(kShakespeare);
  expected.insert(expected.end(), ref.begin(), ref.end());

  CHECK(s.num_documents == 1);
  CHECK(s.num_bytes == 1115394);
  CHECK(s.num_tokens == 338026);
  REQUIRE(s.shards.size() == 2);
  CHECK(s.shards[0].path == dir / "shakespeare/val_000000.bin");
  CHECK(s.shards[0].num_tokens == 32768);
  CHECK(s.shards[1].path == dir / "shakespeare/train_000000.bin");
  CHECK(s.shards[1].num_tokens == 338026 - 32768);
  CHECK(names_in(dir / "shakespeare") == std::vector<std::string>{"train_000000.bin", "val_000000.bin"});

  std::vector<int32_t> got = as_ids(read_shard(s.shards[0].path));
  const std::vector<int32_t> train = as_ids(read_shard(s.shards[1].path));
  got.insert(got.end(), train.begin(), train.end());
  CHECK(got == expected);
}

TEST_CASE("prepare: each file a document after <|endoftext|>, train cut into shards", "[data][prepare]") {
  TempDir dir;
  write_bytes(dir / "a.txt", "Hello world");
  write_bytes(dir / "b.txt", "");
  write_bytes(dir / "c.txt", "It's 2024!");
  PrepareOptions o = quiet({dir / "a.txt", dir / "b.txt", dir / "c.txt"}, dir / "out");
  o.val_tokens = 2;
  o.shard_tokens = 3;
  o.name = "tiny";
  const PrepareSummary s = prepare_shards(o);
  // Ids from tiktoken's gpt2: "Hello world" = 15496 995, "It's 2024!" = 1026 338 48609 0.
  const std::vector<int32_t> stream = {50256, 15496, 995, 50256, 50256, 1026, 338, 48609, 0};
  CHECK(s.num_documents == 3);
  CHECK(s.num_tokens == 9);
  CHECK(names_in(dir / "out") ==
        std::vector<std::string>{"tiny_train_000000.bin", "tiny_train_000001.bin", "tiny_train_000002.bin",
                                 "tiny_val_000000.bin"});
  auto part = [&](int64_t begin, int64_t end) {
    return std::vector<int32_t>(stream.begin() + begin, stream.begin() + end);
  };
  CHECK(as_ids(read_shard(dir / "out/tiny_val_000000.bin")) == part(0, 2));
  CHECK(as_ids(read_shard(dir / "out/tiny_train_000000.bin")) == part(2, 5));
  CHECK(as_ids(read_shard(dir / "out/tiny_train_000001.bin")) == part(5, 8));
  CHECK(as_ids(read_shard(dir / "out/tiny_train_000002.bin")) == part(8, 9));
  REQUIRE(s.shards.size() == 4);
  CHECK(s.shards[0].path == dir / "out/tiny_val_000000.bin");
  CHECK(s.shards[3].num_tokens == 1);
}

TEST_CASE("prepare: byte tokenizer concatenates files as they are; no val shard when 0", "[data][prepare]") {
  TempDir dir;
  const std::string a = "abc\n", b = std::string("\xFF\x00 raw", 6);
  write_bytes(dir / "a.txt", a);
  write_bytes(dir / "b.txt", b);
  PrepareOptions o = quiet({dir / "a.txt", dir / "b.txt"}, dir / "out");
  o.tokenizer = "byte";
  o.val_tokens = 0;
  const PrepareSummary s = prepare_shards(o);
  CHECK(names_in(dir / "out") == std::vector<std::string>{"train_000000.bin"});
  const std::vector<uint32_t> tokens = read_shard(dir / "out/train_000000.bin");
  const std::string all = a + b;
  REQUIRE(tokens.size() == all.size());
  for (size_t i = 0; i < all.size(); ++i) CHECK(tokens[i] == static_cast<uint8_t>(all[i]));
  CHECK(s.tokenizer == "byte");
}

TEST_CASE("prepare: ill-formed UTF-8 names file, offset and line, and writes nothing", "[data][prepare][errors]") {
  TempDir dir;
  const std::string bad = dir / "bad.txt";
  write_bytes(bad, "line one\nline two\nthree \xC3\x28 here\n");
  PrepareOptions o = quiet({bad}, dir / "out");
  o.val_tokens = 1;
  CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains(bad) && Catch::Contains("byte offset 24") &&
                                           Catch::Contains("line 3") && Catch::Contains("--invalid-utf8 replace"));
  CHECK(!fs::exists(dir / "out"));

  SECTION("--invalid-utf8 replace substitutes U+FFFD as Python does") {
    o.replace_invalid_utf8 = true;
    const PrepareSummary s = prepare_shards(o);
    CHECK(s.num_replaced == 1);
    std::vector<int32_t> expected = {50256};
    const std::vector<int32_t> ref = reference_gpt2_ids(bad, "replace");
    expected.insert(expected.end(), ref.begin(), ref.end());
    std::vector<int32_t> got = as_ids(read_shard(dir / "out/val_000000.bin"));
    const std::vector<int32_t> train = as_ids(read_shard(dir / "out/train_000000.bin"));
    got.insert(got.end(), train.begin(), train.end());
    CHECK(got == expected);
  }
}

TEST_CASE("prepare: existing shards need overwrite, which removes stale ones", "[data][prepare]") {
  TempDir dir;
  write_bytes(dir / "a.txt", "one two three four five six seven eight nine ten");
  PrepareOptions o = quiet({dir / "a.txt"}, dir / "out");
  o.val_tokens = 2;
  o.shard_tokens = 3;
  prepare_shards(o);
  CHECK(names_in(dir / "out").size() == 4);  // 11 tokens: val 2, train 3 + 3 + 3
  write_bytes(dir / "out/notes.txt", "keep me");

  o.shard_tokens = 100;
  CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains(dir / "out") && Catch::Contains("--overwrite") &&
                                           Catch::Contains("4 shard(s)"));
  CHECK(names_in(dir / "out").size() == 5);  // untouched

  o.overwrite = true;
  prepare_shards(o);
  CHECK(names_in(dir / "out") == std::vector<std::string>{"notes.txt", "train_000000.bin", "val_000000.bin"});
  CHECK(read_shard(dir / "out/train_000000.bin").size() == 9);

  o.name = "other";  // another prefix does not clash
  o.overwrite = false;
  prepare_shards(o);
  CHECK(names_in(dir / "out").size() == 5);
}

TEST_CASE("prepare: bad inputs and options are errors that write nothing", "[data][prepare][errors]") {
  TempDir dir;
  write_bytes(dir / "a.txt", "just a few tokens");
  SECTION("missing input") {
    PrepareOptions o = quiet({dir / "a.txt", dir / "missing.txt"}, dir / "out");
    CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains(dir / "missing.txt") && Catch::Contains("No such file"));
  }
  SECTION("a directory without text or JSONL files") {
    fs::create_directories(dir / "empty/sub");
    write_bytes(dir / "empty/sub/notes.md", "not an input\n");
    PrepareOptions o = quiet({dir / "empty"}, dir / "out");
    CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains(dir / "empty") && Catch::Contains("holds no .txt"));
  }
  SECTION("fewer tokens than --val-tokens") {
    PrepareOptions o = quiet({dir / "a.txt"}, dir / "out");
    CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains("--val-tokens = 32768") && Catch::Contains("make 5 tokens"));
    CHECK(names_in(dir / "out").empty());  // no shard, no staging directory left
  }
  SECTION("missing tokenizer files") {
    PrepareOptions o = quiet({dir / "a.txt"}, dir / "out");
    o.tokenizer_dir = dir / "nowhere";
    CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains(dir / "nowhere/encoder.json"));
  }
  SECTION("bad sizes") {
    PrepareOptions o = quiet({dir / "a.txt"}, dir / "out");
    o.shard_tokens = 0;
    CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains("--shard-tokens"));
  }
  CHECK((!fs::exists(dir / "out") || names_in(dir / "out").empty()));
}

TEST_CASE("moetrain prepare: a missing input exits 2 with a one-line error", "[data][prepare]") {
  const std::string exe = kBinaryDir + "/moetrain";
  REQUIRE(fs::exists(exe));
  TempDir dir;
  const std::string log = dir / "log.txt";
  const int rc = run_command(shell_quote(exe) + " prepare " + shell_quote(dir / "missing.txt") + " --out " +
                             shell_quote(dir / "out") + " > " + shell_quote(log) + " 2>&1");
  CHECK(rc == 2);
  const std::string out = read_bytes(log);
  CHECK(std::count(out.begin(), out.end(), '\n') == 1);
  CHECK_THAT(out, Catch::Contains(dir / "missing.txt") && Catch::Contains("No such file or directory"));
  CHECK(!fs::exists(dir / "out"));
}

TEST_CASE("moetrain prepare: writes the shards and prints a summary", "[data][prepare]") {
  const std::string exe = kBinaryDir + "/moetrain";
  REQUIRE(fs::exists(exe));
  TempDir dir;
  write_bytes(dir / "a.txt", "First Citizen:\nBefore we proceed any further, hear me speak.\n");
  const std::string out = dir / "stdout.txt", err = dir / "stderr.txt";
  const int rc = run_command(shell_quote(exe) + " prepare " + shell_quote(dir / "a.txt") + " --out " +
                             shell_quote(dir / "out") + " --tokenizer-dir " + shell_quote(kGpt2Dir) +
                             " --val-tokens 4 --name shk > " + shell_quote(out) + " 2> " + shell_quote(err));
  REQUIRE(rc == 0);
  CHECK(names_in(dir / "out") == std::vector<std::string>{"shk_train_000000.bin", "shk_val_000000.bin"});
  const std::vector<int32_t> ids = Gpt2Tokenizer(kGpt2Dir).encode(read_bytes(dir / "a.txt"));
  CHECK(read_shard(dir / "out/shk_val_000000.bin").size() == 4);
  CHECK(read_shard(dir / "out/shk_train_000000.bin").size() == ids.size() + 1 - 4);
  const std::string summary = read_bytes(out);
  CHECK_THAT(summary, Catch::Contains(fmt::format("prepared {} tokens (gpt2) from 1 document(s)", ids.size() + 1)) &&
                          Catch::Contains(dir / "out/shk_val_000000.bin") && Catch::Contains("4 tokens"));
  // Not a terminal: plain progress lines, no carriage returns.
  const std::string progress = read_bytes(err);
  CHECK_THAT(progress, Catch::StartsWith("tokenizing: 100%"));
  CHECK(progress.find('\r') == std::string::npos);
  // Bad option values are CLI11's usage errors, not crashes.
  CHECK(run_command(shell_quote(exe) + " prepare " + shell_quote(dir / "a.txt") + " --out " + shell_quote(dir / "o2") +
                    " --tokenizer nope > /dev/null 2>&1") != 0);
}
