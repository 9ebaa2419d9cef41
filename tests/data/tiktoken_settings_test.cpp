// A tiktoken rank file's description from the command line (data/tiktoken.h
// TiktokenSettings: prepare --tiktoken-pattern, --special-token,
// --document-prefix, --document-suffix): the presets and special tokens give the
// originals' ids of the committed fixtures (tests/data/bpe/, written by
// tests/reference/bpe_reference.py from tiktoken), and what disagrees with the
// description beside the file is refused naming the option and the file.
#include <catch2/catch.hpp>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe.h"
#include "data/tiktoken.h"
#include "data/tokenizer.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;

namespace {

const std::string kTtsFixtures = kSourceDir + "/tests/data/bpe";

// The rank file `name` copied into `dir` without its description.
std::string tts_bare_rank_file(const TempDir& dir, const std::string& name) {
  const std::string path = dir / name;
  write_bytes(path, read_bytes(kTtsFixtures + "/" + name));
  return path;
}

TiktokenSettings tts_settings(const std::string& pattern) {
  TiktokenSettings s;
  s.pattern = pattern;
  s.special_tokens = {{"<|begin_of_text|>", 700}, {"<|end_of_text|>", 701}};
  s.document_prefix = {"<|begin_of_text|>"};
  return s;
}

}  // namespace

TEST_CASE("tiktoken settings: presets and special tokens give tiktoken's ids of the fixtures", "[data][tokenizer][bpe]") {
  TempDir tmp;
  const nlohmann::json texts = nlohmann::json::parse(read_bytes(kTtsFixtures + "/texts.json"));
  const nlohmann::json expected = nlohmann::json::parse(read_bytes(kTtsFixtures + "/expected.json"));
  for (const auto& [file, preset] : std::vector<std::pair<std::string, std::string>>{
           {"llama3.tiktoken", "llama3"}, {"o200k_style.tiktoken", "o200k"}, {"kimi_style.tiktoken", "kimi"}}) {
    INFO(file << " with --tiktoken-pattern " << preset);
    // The preset is the very pattern the fixture's description holds.
    const nlohmann::json description = nlohmann::json::parse(read_bytes(kTtsFixtures + "/" + file + ".json"));
    REQUIRE(tiktoken_pattern_preset(preset) != nullptr);
    CHECK(*tiktoken_pattern_preset(preset) == description["pattern"].get<std::string>());
    const std::string rank = tts_bare_rank_file(tmp, file);
    const auto tok = make_tokenizer(rank, "", tts_settings(preset));
    CHECK(tok->vocab_size() == 702);
    CHECK(tok->document_tokens().prefix == std::vector<int32_t>{700});
    int64_t compared = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string text = texts[i].get<std::string>();
      INFO("text " << i << ": " << text.substr(0, 80));
      CHECK(tok->encode(text) == expected[file][i].get<std::vector<int32_t>>());
      compared += static_cast<int64_t>(expected[file][i].size());
    }
    CHECK(compared > 1000);
    // The same pattern written out, rather than named.
    const auto literal = make_tokenizer(rank, "", tts_settings(description["pattern"].get<std::string>()));
    CHECK(literal->encode(texts[4].get<std::string>()) == expected[file][4].get<std::vector<int32_t>>());
  }
  // Another preset than the fixture's cuts the text differently (o200k splits case changes).
  const std::string rank = tmp / "llama3.tiktoken";
  auto pieces = [&](const std::string& preset) {
    const auto tok = make_tokenizer(rank, "", tts_settings(preset));
    return dynamic_cast<const BpeTokenizer&>(*tok).pre_tokenize("MixedCASE camelCase HTTPServer");
  };
  CHECK(pieces("llama3") == std::vector<std::string>{"MixedCASE", " camelCase", " HTTPServer"});
  CHECK(pieces("o200k") == std::vector<std::string>{"Mixed", "CASE", " camel", "Case", " HTTPServer"});
}

TEST_CASE("tiktoken settings: agreeing with the description adds to it; disagreeing is refused naming both",
          "[data][tokenizer][bpe][errors]") {
  TempDir tmp;
  const std::string rank = tmp / "llama3.tiktoken";
  write_bytes(rank, read_bytes(kTtsFixtures + "/llama3.tiktoken"));
  write_bytes(rank + ".json", read_bytes(kTtsFixtures + "/llama3.tiktoken.json"));
  // The same values as the file: accepted, same ids.
  const auto same = make_tokenizer(rank, "", tts_settings("llama3"));
  CHECK(same->encode("Hello<|end_of_text|> world") == make_tokenizer(rank, "")->encode("Hello<|end_of_text|> world"));
  // A new special token on a free id: added.
  TiktokenSettings extra;
  extra.special_tokens = {{"<|tool|>", 702}};
  const auto more = make_tokenizer(rank, "", extra);
  CHECK(more->vocab_size() == 703);
  std::vector<int32_t> want = more->encode("a");
  want.push_back(702);
  for (int32_t id : more->encode("b")) want.push_back(id);
  CHECK(more->encode("a<|tool|>b") == want);
  CHECK(more->document_tokens().prefix == std::vector<int32_t>{700});  // the file's document_prefix stays

  TiktokenSettings pattern;
  pattern.pattern = "o200k";
  CHECK_THROWS_WITH(make_tokenizer(rank, "", pattern),
                    Catch::Contains("--tiktoken-pattern o200k differs from the pattern of " + rank + ".json"));
  TiktokenSettings other_id;
  other_id.special_tokens = {{"<|end_of_text|>", 702}};
  CHECK_THROWS_WITH(make_tokenizer(rank, "", other_id),
                    Catch::Contains("--special-token <|end_of_text|>=702 differs from " + rank +
                                    ".json, which gives \"<|end_of_text|>\" the id 701"));
  TiktokenSettings taken;
  taken.special_tokens = {{"<|tool|>", 700}};
  CHECK_THROWS_WITH(make_tokenizer(rank, "", taken),
                    Catch::Contains("--special-token <|tool|>=700: " + rank + ".json gives the id 700 to "
                                    "\"<|begin_of_text|>\" already"));
  TiktokenSettings prefix;
  prefix.special_tokens = {{"<|tool|>", 702}};
  prefix.document_prefix = {"<|tool|>"};
  CHECK_THROWS_WITH(make_tokenizer(rank, "", prefix), Catch::Contains("--document-prefix [\"<|tool|>\"] differs from "
                                                                      "[\"<|begin_of_text|>\"] in " + rank + ".json"));
}

TEST_CASE("tiktoken settings: hostile values are refused naming the option", "[data][tokenizer][bpe][errors]") {
  TempDir tmp;
  const std::string rank = tts_bare_rank_file(tmp, "llama3.tiktoken");
  TiktokenSettings none;
  none.special_tokens = {{"<|endoftext|>", 700}};
  CHECK_THROWS_WITH(make_tokenizer(rank, "", none),
                    Catch::Contains("no description beside it") && Catch::Contains("no --tiktoken-pattern"));
  TiktokenSettings bad_regex;
  bad_regex.pattern = "(?i:'s|[a-";
  CHECK_THROWS_WITH(make_tokenizer(rank, "", bad_regex), Catch::Contains("--tiktoken-pattern"));
  TiktokenSettings rank_clash = tts_settings("llama3");
  rank_clash.special_tokens.push_back({"<|x|>", 5});  // a rank file token's id
  CHECK_THROWS_WITH(make_tokenizer(rank, "", rank_clash),
                    Catch::Contains("special_tokens gives \"<|x|>\" the id 5, which the rank file gives a token"));
  TiktokenSettings twice = tts_settings("llama3");
  twice.special_tokens.push_back({"<|x|>", 700});
  CHECK_THROWS_WITH(make_tokenizer(rank, "", twice),
                    Catch::Contains("--special-token gives the id 700 to \"<|begin_of_text|>\" and \"<|x|>\""));
  TiktokenSettings unknown_prefix = tts_settings("llama3");
  unknown_prefix.document_prefix = {"<|nope|>"};
  CHECK_THROWS_WITH(make_tokenizer(rank, "", unknown_prefix),
                    Catch::Contains("document_prefix names \"<|nope|>\", which is not in special_tokens"));
  // Ids that would size the tables by themselves (2e9 rows: out of memory) are refused first.
  TiktokenSettings huge = tts_settings("llama3");
  huge.special_tokens.push_back({"<|x|>", 2'000'000'000});
  CHECK_THROWS_WITH(make_tokenizer(rank, "", huge),
                    Catch::Contains("gives \"<|x|>\" the id 2000000000; ids are integers in [0, 16777216)"));
  write_bytes(tmp / "big_rank.tiktoken", read_bytes(rank) + "QUJDREVGR0g= 2000000000\n");
  CHECK_THROWS_WITH(make_tokenizer(tmp / "big_rank.tiktoken", "", tts_settings("llama3")),
                    Catch::Contains("big_rank.tiktoken:701: rank 2000000000: moetrain reads ranks (ids) below 16777216"));
  // Settings for a tokenizer that is no tiktoken rank file.
  CHECK_THROWS_WITH(make_tokenizer("gpt2", kGpt2Dir, tts_settings("llama3")),
                    Catch::Contains("describe a tiktoken rank file; --tokenizer is gpt2"));
  CHECK_THROWS_WITH(make_tokenizer(kTtsFixtures + "/llama3_nfc.tokenizer.json", "", tts_settings("llama3")),
                    Catch::Contains("a Hugging Face tokenizer.json carries its own pattern"));
  // --special-token's syntax.
  CHECK(parse_special_token_option("<|a=b|>=7") == std::pair<std::string, int64_t>{"<|a=b|>", 7});
  for (const char* bad : {"<|x|>", "=5", "<|x|>=", "<|x|>=-1", "<|x|>=1e3", "<|x|>=16777216", "<|x|>=99999999999"})
    CHECK_THROWS_WITH(parse_special_token_option(bad), Catch::Contains("--special-token") &&
                                                           Catch::Contains("expected NAME=ID"));
}
