// `moetrain export` writes the run's tokenizer (data.tokenizer) as tokenizer.json and
// tokenizer_config.json (data/hf_tokenizer_files.h, docs/export.md#tokenizer-files),
// and transformers' AutoTokenizer loaded from the export gives moetrain's ids
// (tests/reference/hf_tokenizer_check.py; needs a Python with transformers,
// testing::hf_python in cli_fixtures.h, as CI has it in build/venv-hf-ci; else tokenizers'
// Tokenizer.from_file with $MOETRAIN_TOKENIZERS_PYTHON; that part is skipped with one
// line without either). A tokenizer that cannot be read gives one
// warning and an export without tokenizer files.
#include <cstdlib>
#include <filesystem>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "cli_fixtures.h"
#include "config/config.h"
#include "data/tokenizer.h"
#include "moetrain.h"
#include "testing.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

const string kExportTokFixtures = string(MOETRAIN_SOURCE_DIR) + "/tests/data/bpe";

bool export_tok_python_has(const string& python, const string& modules) {
  return (python.find('/') == string::npos || fs::exists(python)) &&
         moetrain::testing::run_command(moetrain::testing::shell_quote(python) + " -c 'import " + modules +
                                        "' >/dev/null 2>&1") == 0;
}

// A Python with transformers (testing::hf_python in cli_fixtures.h), else one with tokenizers
// ($MOETRAIN_TOKENIZERS_PYTHON, as launch/test.sh sets it), else "".
string export_tok_python() {
  if (string python = moetrain::testing::hf_python("tokenizers"); !python.empty()) return python;
  if (const char* env = std::getenv("MOETRAIN_TOKENIZERS_PYTHON"); env && *env && export_tok_python_has(env, "tokenizers"))
    return env;
  return "";
}

// A tiny GPT-2 model directory as `train` writes it, trained with data.tokenizer = `tokenizer`.
void write_tiny_model(const string& dir, const string& tokenizer) {
  ModelSource source;
  source.config_path = string(MOETRAIN_SOURCE_DIR) + "/configs/gpt2-shakespeare.yaml";
  source.overrides = {"model.n_layer=1", "model.n_head=2", "model.d_model=16", "model.n_ctx=32",
                      "model.vocab_size=256", "train.seq_len=16", "data.tokenizer=" + tokenizer,
                      "data.tokenizer_dir=" + string(MOETRAIN_SOURCE_DIR) + "/data/gpt2"};
  Config config = resolve_config(source);
  std::unique_ptr<LanguageModel> model = build_model(config);
  export_model(*model, dir);
  config.save(dir + "/config.resolved.yaml");
}

// moetrain's ids for the stress texts and a page of Shakespeare, for hf_tokenizer_check.py.
nlohmann::json moetrain_cases(const string& tokenizer) {
  const auto tok = data::make_tokenizer(tokenizer, string(MOETRAIN_SOURCE_DIR) + "/data/gpt2");
  std::vector<string> texts = nlohmann::json::parse(testing::read_bytes(kExportTokFixtures + "/texts.json"));
  texts.push_back(testing::read_bytes(string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt").substr(0, 20000));
  nlohmann::json cases = nlohmann::json::array();
  const data::DocumentTokens around = tok->document_tokens();
  for (const string& text : texts) {
    if (tokenizer == "gpt2" && text.find("<|endoftext|>") != string::npos) continue;  // docs/export.md
    std::vector<int32_t> ids = tok->encode(text), doc = around.prefix;
    doc.insert(doc.end(), ids.begin(), ids.end());
    doc.insert(doc.end(), around.suffix.begin(), around.suffix.end());
    cases.push_back({{"text", text}, {"ids", ids}, {"document", doc}, {"decoded", tok->decode(ids)}});
  }
  return cases;
}

}  // namespace

TEST_CASE("export tokenizer: AutoTokenizer on the export gives moetrain's ids", "[cli][hf]") {
  TempDir tmp;
  const string python = export_tok_python();
  if (python.empty())
    WARN("skipped the comparison with transformers: no Python with transformers or tokenizers (set MOETRAIN_HF_PYTHON "
         "or MOETRAIN_TOKENIZERS_PYTHON; docs/export.md)");
  struct Case {
    string tokenizer, bos, eos;
  };
  const std::vector<Case> cases = {
      {"gpt2", "<|endoftext|>", "<|endoftext|>"},
      {"byte", "", ""},
      {kExportTokFixtures + "/llama3_nfc.tokenizer.json", "<|begin_of_text|>", "<|end_of_text|>"},
      {kExportTokFixtures + "/llama3.tiktoken", "<|begin_of_text|>", "<|end_of_text|>"},
      {kExportTokFixtures + "/o200k_style.tiktoken", "<|begin_of_text|>", "<|end_of_text|>"},
      {kExportTokFixtures + "/kimi_style.tiktoken", "<|begin_of_text|>", "<|end_of_text|>"},
  };
  int n = 0;
  for (const Case& c : cases) {
    INFO(c.tokenizer);
    const string model = tmp / ("model" + std::to_string(n)), out = tmp / ("out" + std::to_string(n));
    ++n;
    write_tiny_model(model, c.tokenizer);
    const testing::CommandOutput r =
        testing::run_moetrain("export --checkpoint " + model + " --out " + out + " --no-progress");
    INFO(r.output);
    REQUIRE(r.code == 0);
    REQUIRE(fs::exists(out + "/tokenizer.json"));
    REQUIRE(fs::exists(out + "/tokenizer_config.json"));
    CHECK_THAT(r.output, !Catch::Contains("no tokenizer files"));
    if (python.empty()) continue;
    const nlohmann::json config = nlohmann::json::parse(testing::read_bytes(out + "/tokenizer_config.json"));
    nlohmann::json spec = {{"bos", config.value("bos_token", nlohmann::json())},
                           {"eos", config.value("eos_token", nlohmann::json())},
                           {"cases", moetrain_cases(c.tokenizer)}};
    if (!c.bos.empty()) CHECK(spec["bos"] == c.bos);
    if (!c.eos.empty()) CHECK(spec["eos"] == c.eos);
    testing::write_bytes(tmp / "cases.json", spec.dump());
    const testing::CommandOutput check = testing::capture_command(
        testing::shell_quote(python) + " " + string(MOETRAIN_SOURCE_DIR) + "/tests/reference/hf_tokenizer_check.py " +
        out + " " + tmp / "cases.json");
    INFO(check.output);
    CHECK(check.code == 0);
    CHECK_THAT(check.output, Catch::Contains("all equal"));
  }
}

TEST_CASE("export tokenizer: a tokenizer that cannot be read is one warning and no tokenizer files", "[cli]") {
  TempDir tmp;
  testing::write_bytes(tmp / "tok.tiktoken", testing::read_bytes(kExportTokFixtures + "/llama3.tiktoken"));
  testing::write_bytes(tmp / "tok.tiktoken.json", testing::read_bytes(kExportTokFixtures + "/llama3.tiktoken.json"));
  write_tiny_model(tmp / "model", tmp / "tok.tiktoken");
  fs::remove(tmp / "tok.tiktoken");  // moved away since training
  const testing::CommandOutput r =
      testing::run_moetrain("export --checkpoint " + tmp / "model" + " --out " + tmp / "out" + " --no-progress");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("no tokenizer files: data.tokenizer " + tmp / "tok.tiktoken") &&
                           Catch::Contains("without tokenizer.json"));
  CHECK(fs::exists(tmp / "out/model.safetensors"));
  CHECK_FALSE(fs::exists(tmp / "out/tokenizer.json"));
  CHECK_FALSE(fs::exists(tmp / "out/tokenizer_config.json"));
}
