// prepare's options for tokenizer files on the command line: --tiktoken-pattern /
// --special-token / --document-prefix for a rank file without its description
// give the shards the description gives; conflicts exit 2 naming the option and
// the file; --chunk-bytes does not change the shards; a second prepare into an
// out_dir another one holds exits 2 and leaves it alone.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "testing.h"

using moetrain::testing::CommandOutput;
using moetrain::testing::read_bytes;
using moetrain::testing::run_moetrain;
using moetrain::testing::TempDir;
using moetrain::testing::write_bytes;
using std::string;

namespace {
const string kPocFixtures = string(MOETRAIN_SOURCE_DIR) + "/tests/data/bpe";
const string kPocCorpus = string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt";
}  // namespace

TEST_CASE("prepare options cli: tiktoken settings on the command line equal the description", "[cli][data]") {
  TempDir tmp;
  write_bytes(tmp / "bare.tiktoken", read_bytes(kPocFixtures + "/llama3.tiktoken"));
  const string common = "prepare " + kPocCorpus + " --val-tokens 1000 ";
  const CommandOutput described =
      run_moetrain(common + "--out " + tmp / "a" + " --tokenizer " + kPocFixtures + "/llama3.tiktoken");
  INFO(described.output);
  REQUIRE(described.code == 0);
  const CommandOutput options = run_moetrain(
      common + "--out " + tmp / "b" + " --tokenizer " + tmp / "bare.tiktoken" +
      " --tiktoken-pattern llama3 --special-token '<|begin_of_text|>=700' --special-token '<|end_of_text|>=701'"
      " --document-prefix '<|begin_of_text|>'");
  INFO(options.output);
  REQUIRE(options.code == 0);
  for (const char* shard : {"/val_000000.bin", "/train_000000.bin"})
    CHECK(read_bytes(tmp / "a" + shard) == read_bytes(tmp / "b" + shard));

  // Conflicts with the description beside the file: exit 2 naming the option and the file.
  write_bytes(tmp / "bare.tiktoken.json", read_bytes(kPocFixtures + "/llama3.tiktoken.json"));
  const CommandOutput clash = run_moetrain(common + "--out " + tmp / "c" + " --tokenizer " + tmp / "bare.tiktoken" +
                                           " --special-token '<|end_of_text|>=702'");
  CHECK(clash.code == 2);
  CHECK_THAT(clash.output, Catch::Contains("--special-token <|end_of_text|>=702 differs from " + tmp /
                                           "bare.tiktoken.json"));
  const CommandOutput pattern = run_moetrain(common + "--out " + tmp / "c" + " --tokenizer " + tmp / "bare.tiktoken" +
                                             " --tiktoken-pattern kimi");
  CHECK(pattern.code == 2);
  CHECK_THAT(pattern.output, Catch::Contains("--tiktoken-pattern kimi differs from the pattern of " + tmp /
                                             "bare.tiktoken.json"));
  const CommandOutput bad = run_moetrain(common + "--out " + tmp / "c" + " --tokenizer " + tmp / "bare.tiktoken" +
                                         " --special-token nonsense");
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("--special-token nonsense: expected NAME=ID"));
  CHECK_FALSE(std::filesystem::exists(tmp / "c/train_000000.bin"));
}

TEST_CASE("prepare options cli: --chunk-bytes keeps the shards; a locked out_dir is refused", "[cli][data]") {
  TempDir tmp;
  const string tok = kPocFixtures + "/llama3_nfc.tokenizer.json";
  const string common = "prepare " + kPocCorpus + " --tokenizer " + tok + " --val-tokens 1000 ";
  const CommandOutput whole = run_moetrain(common + "--out " + tmp / "whole --chunk-bytes 1073741824");
  REQUIRE(whole.code == 0);
  const CommandOutput parts = run_moetrain("--threads 2 " + common + "--out " + tmp / "parts --chunk-bytes 300");
  REQUIRE(parts.code == 0);
  CHECK(read_bytes(tmp / "whole/train_000000.bin") == read_bytes(tmp / "parts/train_000000.bin"));
  CHECK(read_bytes(tmp / "whole/val_000000.bin") == read_bytes(tmp / "parts/val_000000.bin"));

  // Another prepare holds the directory (as this process does here): refused, nothing touched.
  const int fd = ::open((tmp / "whole").c_str(), O_RDONLY | O_DIRECTORY);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
  const string before = read_bytes(tmp / "whole/train_000000.bin");
  const CommandOutput locked = run_moetrain(common + "--out " + tmp / "whole --overwrite");
  ::close(fd);
  CHECK(locked.code == 2);
  CHECK_THAT(locked.output, Catch::Contains("prepare --out " + tmp / "whole" + ": another prepare is writing shards "
                                            "into it now"));
  CHECK(read_bytes(tmp / "whole/train_000000.bin") == before);
  const CommandOutput unlocked = run_moetrain(common + "--out " + tmp / "whole --overwrite");
  CHECK(unlocked.code == 0);
}
