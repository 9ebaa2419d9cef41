// The BPE engine (data/bpe.h) against the originals, Hugging Face `tokenizers`
// and `tiktoken`: tests/reference/bpe_reference.py trains small byte-level
// tokenizers on the shipped corpus (Llama 3's pattern with NFC, GPT-2's
// ByteLevel, DeepSeek's Sequence of Splits, every split behaviour; the same
// vocabulary as tiktoken rank files with Llama 3's and o200k's patterns) and
// writes the originals' ids of stress texts: committed in tests/data/bpe/,
// compared here always. Where python3 imports tokenizers and tiktoken
// ($MOETRAIN_TOKENIZERS_PYTHON, else python3 on PATH) the script is rerun
// against the installed originals, and a tokenizer of more than 65,536 tokens
// and GPT-2's tables (as tokenizer.json and as rank file) are built and compared
// as well; without them those cases skip with a line saying so.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;

namespace {

const std::string kBpeFixtures = kSourceDir + "/tests/data/bpe";

// Compares every tokenizer of `dir`/expected.json on `dir`/texts.json; returns how many ids were compared.
int64_t compare_with_originals(const std::string& dir) {
  const nlohmann::json texts = nlohmann::json::parse(read_bytes(dir + "/texts.json"));
  const nlohmann::json expected = nlohmann::json::parse(read_bytes(dir + "/expected.json"));
  int64_t compared = 0;
  REQUIRE(expected.size() >= 2);
  for (const auto& [name, ids_per_text] : expected.items()) {
    std::unique_ptr<Tokenizer> tok = load_tokenizer_file(dir + "/" + name);
    REQUIRE(ids_per_text.size() == texts.size());
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string text = texts[i].get<std::string>();
      const std::vector<int32_t> want = ids_per_text[i].get<std::vector<int32_t>>();
      INFO(name << ", text " << i << ": \"" << text.substr(0, 200) << "\"");
      const std::vector<int32_t> got = tok->encode(text);
      CHECK(got == want);
      compared += static_cast<int64_t>(want.size());
    }
  }
  return compared;
}

// The python3 that imports tokenizers and tiktoken, or "" (with the reason in `why`).
std::string reference_python(std::string& why) {
  const char* env = std::getenv("MOETRAIN_TOKENIZERS_PYTHON");
  const std::string py = env != nullptr && *env != '\0' ? env : "python3";
  const auto r = moetrain::testing::capture_command(shell_quote(py) + " -c 'import tokenizers, tiktoken'");
  if (r.code == 0) return py;
  why = py + " cannot import tokenizers and tiktoken (pip install tokenizers tiktoken in a venv and set "
             "MOETRAIN_TOKENIZERS_PYTHON to its python): " + r.output.substr(0, 200);
  return "";
}

std::string run_reference(const std::string& py, const std::string& mode, const std::string& out) {
  const auto r = moetrain::testing::capture_command(shell_quote(py) + " " + shell_quote(kSourceDir + "/tests/reference/bpe_reference.py") +
                             " " + mode + " " + shell_quote(out));
  INFO(r.output);
  REQUIRE(r.code == 0);
  return out;
}

std::string with_field(const std::string& json_path, const std::function<void(nlohmann::json&)>& edit,
                       const std::string& out_path) {
  nlohmann::json j = nlohmann::json::parse(read_bytes(json_path));
  edit(j);
  write_bytes(out_path, j.dump());
  return out_path;
}

}  // namespace

TEST_CASE("bpe: tokenizer.json and tiktoken files equal HF tokenizers and tiktoken (committed fixtures)",
          "[data][tokenizer][bpe]") {
  CHECK(compare_with_originals(kBpeFixtures) > 5000);
}

TEST_CASE("bpe: the reference script rerun against the installed tokenizers and tiktoken", "[data][tokenizer][bpe]") {
  std::string why;
  const std::string py = reference_python(why);
  if (py.empty()) {
    WARN("skipped: " << why);
    return;
  }
  TempDir dir;
  run_reference(py, "fixtures", dir.path());
  CHECK(compare_with_originals(dir.path()) > 5000);
}

TEST_CASE("bpe: more than 65,536 tokens, and GPT-2's tables as tokenizer.json and rank file", "[data][tokenizer][bpe]") {
  std::string why;
  const std::string py = reference_python(why);
  if (py.empty()) {
    WARN("skipped: " << why);
    return;
  }
  TempDir dir;
  run_reference(py, "big", dir.path());
  CHECK(compare_with_originals(dir.path()) > 100000);
  for (const char* name : {"big.tokenizer.json", "big.tiktoken", "big_kimi.tiktoken"}) {
    INFO(name);
    std::unique_ptr<Tokenizer> big = load_tokenizer_file(dir / name);
    CHECK(big->vocab_size() > 65536);
    CHECK(shard_width_for_vocab(big->vocab_size()) == TokenWidth::u32);
    // Ids above 65,535 occur in the compared text, so the comparison covers them.
    const std::vector<int32_t> ids = big->encode(read_bytes(kShakespeare).substr(0, 200000));
    CHECK(std::count_if(ids.begin(), ids.end(), [](int32_t id) { return id > 65535; }) > 10);
    CHECK(big->decode(ids) == read_bytes(kShakespeare).substr(0, 200000));
  }
  // The pieces of the code point sweep under each pattern of the family equal HF's pre_tokenize_str
  // (ids alone miss a moved boundary between bytes that no merge joins).
  const nlohmann::json pieces = nlohmann::json::parse(read_bytes(dir / "pieces.json"));
  const std::string sweep = pieces["text"].get<std::string>();
  REQUIRE(pieces["pieces"].size() == 5);
  for (const auto& [file, want] : pieces["pieces"].items()) {
    INFO(file);
    std::unique_ptr<Tokenizer> tok = load_tokenizer_file(dir / file);
    const auto& bpe = dynamic_cast<const BpeTokenizer&>(*tok);
    const std::vector<std::string> got = bpe.pre_tokenize(sweep), expect = want.get<std::vector<std::string>>();
    CHECK(got.size() == expect.size());
    size_t same = 0;
    while (same < std::min(got.size(), expect.size()) && got[same] == expect[same]) ++same;
    INFO("first difference at piece " << same << ": "
                                      << (same < got.size() ? got[same] : "(end)") << " vs "
                                      << (same < expect.size() ? expect[same] : "(end)"));
    CHECK(same == expect.size());
  }
  // GPT-2 through the engine's two other doors gives GPT-2's own ids.
  const std::string text = read_bytes(kShakespeare).substr(0, 100000);
  const std::vector<int32_t> ids = Gpt2Tokenizer(kGpt2Dir).encode(text);
  CHECK(load_tokenizer_file(dir / "gpt2.tokenizer.json")->encode(text) == ids);
  CHECK(load_tokenizer_file(dir / "gpt2.tiktoken")->encode(text) == ids);
}

TEST_CASE("bpe: decode inverts encode; NFC changes what it composes", "[data][tokenizer][bpe]") {
  const nlohmann::json texts = nlohmann::json::parse(read_bytes(kBpeFixtures + "/texts.json"));
  for (const char* name : {"llama3_nfc.tokenizer.json", "deepseek_style.tokenizer.json", "llama3.tiktoken",
                           "o200k_style.tiktoken", "kimi_style.tiktoken"}) {
    std::unique_ptr<Tokenizer> tok = load_tokenizer_file(kBpeFixtures + "/" + name);
    const bool nfc = std::string_view(name) == "llama3_nfc.tokenizer.json";
    for (const auto& t : texts) {
      const std::string text = t.get<std::string>();
      INFO(name << ": " << text.substr(0, 100));
      CHECK(tok->decode(tok->encode(text)) == (nfc ? nfc_normalize(text) : text));
    }
  }
  // e + U+0301 is é after NFC: one token fewer than without NFC.
  CHECK(nfc_normalize("Cafe\xCC\x81") == "Caf\xC3\xA9");
  CHECK(nfc_normalize("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8") == "\xEA\xB0\x81");  // Hangul jamo -> 각
}

TEST_CASE("bpe: special tokens, document tokens and the vocabulary of each file", "[data][tokenizer][bpe]") {
  std::unique_ptr<Tokenizer> llama = make_tokenizer(kBpeFixtures + "/llama3_nfc.tokenizer.json", "");
  CHECK(llama->vocab_size() == 704);
  CHECK(llama->name() == kBpeFixtures + "/llama3_nfc.tokenizer.json");
  CHECK(llama->needs_utf8());
  CHECK(llama->encodes_in_chunks());  // read in parts cut at find_cut (bpe_chunk_test.cpp)
  // The template "<|begin_of_text|> $A": 700 before each document, nothing after.
  CHECK(llama->document_tokens().prefix == std::vector<int32_t>{700});
  CHECK(llama->document_tokens().suffix.empty());
  CHECK(llama->eot_token() == 700);
  CHECK(llama->encode("<|end_of_text|>") == std::vector<int32_t>{701});
  CHECK(llama->decode(std::vector<int32_t>{700, 701}) == "<|begin_of_text|><|end_of_text|>");
  // No template, no <|endoftext|>: documents are concatenated.
  std::unique_ptr<Tokenizer> gpt2ish = make_tokenizer(kBpeFixtures + "/gpt2_style.tokenizer.json", "");
  CHECK(gpt2ish->document_tokens().prefix.empty());
  std::unique_ptr<Tokenizer> tt = make_tokenizer(kBpeFixtures + "/llama3.tiktoken", "");
  CHECK(tt->vocab_size() == 702);
  CHECK(tt->document_tokens().prefix == std::vector<int32_t>{700});
  CHECK_THROWS_WITH(tt->decode(std::vector<int32_t>{702}), Catch::Contains("id 702") && Catch::Contains("[0, 702)"));
}

TEST_CASE("bpe: ill-formed UTF-8 is an error naming the byte offset", "[data][tokenizer][bpe][errors]") {
  std::unique_ptr<Tokenizer> tok = load_tokenizer_file(kBpeFixtures + "/llama3_nfc.tokenizer.json");
  CHECK_THROWS_WITH(tok->encode("ok \xC0\xAF"), Catch::Contains("byte offset 3") && Catch::Contains("U+FFFD"));
  CHECK_THROWS_WITH(load_tokenizer_file(kBpeFixtures + "/llama3.tiktoken")->encode("\xED\xA0\x80"),
                    Catch::Contains("byte offset 0"));
}

TEST_CASE("bpe: what the engine cannot reproduce is refused, naming file and field", "[data][tokenizer][bpe][errors]") {
  TempDir dir;
  const std::string base = kBpeFixtures + "/llama3_nfc.tokenizer.json";
  const std::string bad = dir / "bad.json";
  using J = nlohmann::json;
  struct Case {
    const char* what;
    std::function<void(J&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"model type", [](J& j) { j["model"]["type"] = "WordPiece"; }, {"model.type", "WordPiece"}},
      {"byte fallback", [](J& j) { j["model"]["byte_fallback"] = true; }, {"model.byte_fallback"}},
      {"dropout", [](J& j) { j["model"]["dropout"] = 0.1; }, {"model.dropout"}},
      {"suffix", [](J& j) { j["model"]["end_of_word_suffix"] = "</w>"; }, {"model.end_of_word_suffix"}},
      {"normalizer", [](J& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, {"normalizer.type", "Lowercase"}},
      {"nested normalizer",
       [](J& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "NFKC"}}}}}; },
       {"normalizer.normalizers[1].type", "NFKC"}},
      {"pre-tokenizer", [](J& j) { j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Whitespace"}}; },
       {"pre_tokenizer.pretokenizers[0].type", "Whitespace"}},
      {"behavior", [](J& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; },
       {"pre_tokenizer.pretokenizers[0].behavior", "Sideways"}},
      {"no ByteLevel", [](J& j) { j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0]; },
       {"pre_tokenizer", "ByteLevel"}},
      {"ByteLevel first",
       [](J& j) { std::swap(j["pre_tokenizer"]["pretokenizers"][0], j["pre_tokenizer"]["pretokenizers"][1]); },
       {"pre_tokenizer.pretokenizers[1].type", "after ByteLevel"}},
      {"negated class intersection",
       [](J& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[^\\p{L}&&[^a]]+"; },
       {"pre_tokenizer.pretokenizers[0].pattern.Regex", "negated class intersection"}},
      {"\\S in a class", [](J& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[\\S\\d]+"; },
       {"pre_tokenizer.pretokenizers[0].pattern.Regex", "\\S inside"}},
      {"bad regex", [](J& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(ab"; },
       {"pre_tokenizer.pretokenizers[0].pattern.Regex", "does not compile"}},
      {"lstrip", [](J& j) { j["added_tokens"][0]["lstrip"] = true; }, {"added_tokens[0].lstrip"}},
      {"post-processor", [](J& j) { j["post_processor"] = {{"type", "RobertaProcessing"}}; },
       {"post_processor.type", "RobertaProcessing"}},
      {"decoder", [](J& j) { j["decoder"] = {{"type", "Metaspace"}}; }, {"decoder.type", "Metaspace"}},
      {"no decoder", [](J& j) { j["decoder"] = nullptr; }, {"decoder is null"}},
      {"truncation", [](J& j) { j["truncation"] = {{"max_length", 8}}; }, {"truncation"}},
      {"merge of unknown token", [](J& j) { j["model"]["merges"][3] = "zzq Ġ"; }, {"model.merges[3]", "zzq"}},
      {"merge form", [](J& j) { j["model"]["merges"][2] = "a b c"; }, {"model.merges[2]", "one space"}},
      {"missing byte",
       [](J& j) {
         j["model"]["vocab"]["a space"] = j["model"]["vocab"]["Ā"];  // not the byte alphabet: not a byte token
         j["model"]["vocab"].erase("Ā");
       },
       {"byte 0x00"}},
      {"added token id", [](J& j) { j["added_tokens"][1]["id"] = 900; }, {"added_tokens[1].id", "701"}},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    with_field(base, c.edit, bad);
    std::string message;
    try {
      load_tokenizer_file(bad);
    } catch (const Error& e) {
      message = e.what();
    }
    REQUIRE_FALSE(message.empty());
    CHECK_THAT(message, Catch::StartsWith(bad));
    for (const std::string& needle : c.needles) CHECK_THAT(message, Catch::Contains(needle));
  }
  // tiktoken: rank file lines, the description beside it, its fields.
  const std::string ranks = dir / "r.tiktoken";
  write_bytes(ranks, read_bytes(kBpeFixtures + "/llama3.tiktoken") + "not-base64! 5\n");
  write_bytes(ranks + ".json", read_bytes(kBpeFixtures + "/llama3.tiktoken.json"));
  CHECK_THROWS_WITH(load_tokenizer_file(ranks), Catch::Contains(ranks + ":701:") && Catch::Contains("base64"));
  write_bytes(ranks, read_bytes(kBpeFixtures + "/llama3.tiktoken"));
  std::filesystem::remove(ranks + ".json");
  CHECK_THROWS_WITH(load_tokenizer_file(ranks), Catch::Contains(ranks) && Catch::Contains("description") &&
                                                    Catch::Contains(ranks + ".json"));
  write_bytes(ranks + ".json", R"({"pattern": "\\s+|\\S+", "special_tokens": {"<|x|>": 5}})");
  CHECK_THROWS_WITH(load_tokenizer_file(ranks), Catch::Contains(ranks + ".json: special_tokens") &&
                                                    Catch::Contains("id 5"));
  write_bytes(ranks + ".json", R"({"pattern": "\\s+|\\S+", "patern": 1})");
  CHECK_THROWS_WITH(load_tokenizer_file(ranks), Catch::Contains(ranks + ".json: patern"));
  write_bytes(ranks + ".json", R"({"special_tokens": {}})");
  CHECK_THROWS_WITH(load_tokenizer_file(ranks), Catch::Contains(ranks + ".json: pattern"));
  // The description alone names the rank file.
  write_bytes(dir / "d.json", R"({"tiktoken": "r.tiktoken", "pattern": "\\s+|\\S+"})");
  CHECK(load_tokenizer_file(dir / "d.json")->vocab_size() == 700);
  write_bytes(dir / "d.json", R"({"tiktoken": "missing.tiktoken", "pattern": "\\s+|\\S+"})");
  CHECK_THROWS_WITH(load_tokenizer_file(dir / "d.json"), Catch::Contains("missing.tiktoken"));
  // Neither kind of JSON; a missing file; an unknown name.
  write_bytes(dir / "x.json", R"({"vocab": {}})");
  CHECK_THROWS_WITH(load_tokenizer_file(dir / "x.json"), Catch::Contains("x.json") && Catch::Contains("\"model\""));
  CHECK_THROWS_WITH(make_tokenizer(dir / "nope.json", ""), Catch::Contains("nope.json"));
  CHECK_THROWS_WITH(make_tokenizer("llama", ""), Catch::Contains("\"llama\"") && Catch::Contains("tokenizer.json"));
}

TEST_CASE("bpe: split patterns mean what Oniguruma and fancy-regex mean", "[data][tokenizer][bpe]") {
  using V = std::vector<std::pair<size_t, size_t>>;
  V m;
  // \s is White_Space: U+180E (PCRE2's \s takes it) is not.
  SplitRegex space(translate_split_pattern(R"(\s+)", "t"), "t");
  space.find_matches("a\xE1\xA0\x8E" "b \xE3\x80\x80", m);
  CHECK(m == V{{5, 9}});
  // \p{L} has Unicode 15's letters (U+1E030, Cyrillic modifier letter, new in 15.0).
  SplitRegex letters(translate_split_pattern(R"(\p{L}+)", "t"), "t");
  letters.find_matches("x\xF0\x9E\x80\xB0y", m);
  CHECK(m == V{{0, 6}});
  // Empty matches: onig's find_iter skips an empty match where the last one ended.
  SplitRegex empty(translate_split_pattern(R"(a*)", "t"), "t");
  empty.find_matches("baab", m);
  CHECK(m == V{{0, 0}, {1, 3}, {4, 4}});
  CHECK_THAT(translate_split_pattern(R"([^\s\p{L}])", "t"), Catch::Contains("\\p{L}\\x{"));
  CHECK_THROWS_WITH(translate_split_pattern(R"(\p{Tamil}+)", "f: pattern"),
                    Catch::Contains("f: pattern") && Catch::Contains("\\p{Tamil} is not"));
  CHECK_THROWS_WITH(translate_split_pattern(R"(\w+)", "f: pattern"), Catch::Contains("\\w"));
  // The patterns of the family compile: cl100k (possessive), Qwen2, o200k.
  for (const char* p :
       {R"('(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)",
        R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
        R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"})
    CHECK_NOTHROW(SplitRegex(translate_split_pattern(p, "t"), "t"));
  // Kimi's: \p{Han} (a script: PCRE2's sc:Han) and class intersection, as lookaheads.
  CHECK_THAT(translate_split_pattern(R"([\p{Lu}\p{M}&&[^\p{Han}]]*)", "kimi"),
             Catch::StartsWith("(?:(?=[^\\p{sc:Han}") && Catch::EndsWith(")*"));
  SplitRegex kimi(translate_split_pattern(R"([\p{L}&&[^\p{Han}]]+|[\p{Han}]+)", "kimi"), "kimi");
  kimi.find_matches("ab\xE4\xB8\xAD\xE6\x96\x87" "cd", m);
  CHECK(m == V{{0, 2}, {2, 8}, {8, 10}});
  CHECK_THROWS_WITH(translate_split_pattern(R"([\p{Mn}a])", "f: pattern"), Catch::Contains("took code points out"));
}
