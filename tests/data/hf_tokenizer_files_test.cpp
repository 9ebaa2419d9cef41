// The tokenizer files of an export (data/hf_tokenizer_files.h), read back by
// moetrain's own tokenizer.json reader: the same ids and document tokens as the
// tokenizer they were made from, on the committed stress texts (tests/data/bpe/).
// That transformers reads them the same: tests/cli/export_tokenizer_test.cpp.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "data/hf_tokenizer_files.h"
#include "data/tokenizer.h"
#include "testing.h"

using moetrain::testing::read_bytes;
using moetrain::testing::TempDir;
using moetrain::testing::write_bytes;
using std::string;

namespace {

const string kHftfFixtures = string(MOETRAIN_SOURCE_DIR) + "/tests/data/bpe";

string hftf_file(const std::vector<moetrain::data::HfTokenizerFile>& files, const string& name) {
  for (const auto& f : files)
    if (f.name == name) return f.text;
  FAIL("no " << name);
  return "";
}

}  // namespace

TEST_CASE("hf tokenizer files: generated tokenizer.json encodes as the tokenizer it was made from", "[data]") {
  TempDir tmp;
  const nlohmann::json texts = nlohmann::json::parse(read_bytes(kHftfFixtures + "/texts.json"));
  REQUIRE(texts.size() > 50);
  const string gpt2_dir = string(MOETRAIN_SOURCE_DIR) + "/data/gpt2";
  for (const string& name : {string("gpt2"), string("byte"), kHftfFixtures + "/llama3.tiktoken",
                            kHftfFixtures + "/o200k_style.tiktoken", kHftfFixtures + "/kimi_style.tiktoken",
                            kHftfFixtures + "/llama3_nfc.tokenizer.json"}) {
    INFO(name);
    const auto files = moetrain::data::hf_tokenizer_files(name, gpt2_dir);
    REQUIRE(files.size() == 2);
    const string path = tmp / "tokenizer.json";
    write_bytes(path, hftf_file(files, "tokenizer.json"));
    const auto original = moetrain::data::make_tokenizer(name, gpt2_dir);
    const auto exported = moetrain::data::make_tokenizer(path, "");
    CHECK(exported->vocab_size() == original->vocab_size());
    CHECK(exported->document_tokens().prefix == original->document_tokens().prefix);
    CHECK(exported->document_tokens().suffix == original->document_tokens().suffix);
    size_t compared = 0;
    for (const auto& t : texts) {
      const string text = t.get<string>();
      if (name == "gpt2" && text.find("<|endoftext|>") != string::npos) continue;  // the one difference, below
      INFO(text);
      CHECK(exported->encode(text) == original->encode(text));
      compared += original->encode(text).size();
    }
    CHECK(compared > 1000);
    const nlohmann::json config = nlohmann::json::parse(hftf_file(files, "tokenizer_config.json"));
    CHECK(config["tokenizer_class"] == "PreTrainedTokenizerFast");
    CHECK(config["clean_up_tokenization_spaces"] == false);
    if (name == "gpt2") {
      CHECK(config["bos_token"] == "<|endoftext|>");
      CHECK(config["eos_token"] == "<|endoftext|>");
    } else if (name == "byte") {
      CHECK_FALSE(config.contains("bos_token"));
      CHECK_FALSE(config.contains("eos_token"));
    } else if (name.ends_with("llama3.tiktoken") || name.ends_with("llama3_nfc.tokenizer.json")) {
      CHECK(config["bos_token"] == "<|begin_of_text|>");
    }
  }
  // The one difference, as GPT-2 on the Hub: the export reads "<|endoftext|>" in text as its token.
  const auto gpt2 = moetrain::data::hf_tokenizer_files("gpt2", gpt2_dir);
  write_bytes(tmp / "gpt2.json", hftf_file(gpt2, "tokenizer.json"));
  CHECK(moetrain::data::make_tokenizer(tmp / "gpt2.json", "")->encode("a<|endoftext|>b") ==
        std::vector<int32_t>{64, 50256, 65});
  // A tokenizer.json run's file is copied byte for byte.
  CHECK(hftf_file(moetrain::data::hf_tokenizer_files(kHftfFixtures + "/deepseek_style.tokenizer.json", ""),
                  "tokenizer.json") == read_bytes(kHftfFixtures + "/deepseek_style.tokenizer.json"));
}

TEST_CASE("hf tokenizer files: a tokenizer that cannot be read is an error naming the file", "[data]") {
  TempDir tmp;
  CHECK_THROWS_WITH(moetrain::data::hf_tokenizer_files("gpt2", tmp / "nowhere"),
                    Catch::Contains(tmp / "nowhere/encoder.json"));
  CHECK_THROWS_WITH(moetrain::data::hf_tokenizer_files(tmp / "missing.tiktoken", ""),
                    Catch::Contains(tmp / "missing.tiktoken"));
}
