// `moetrain export` of a run whose data.tokenizer is a Hugging Face tokenizer
// directory with a chat template (tokenizer_config.json beside tokenizer.json):
// the export's tokenizer_config.json carries chat_template and the declared
// bos/eos (always checked), and transformers' AutoTokenizer on the export renders
// the template and tokenizes it as moetrain does (skipped with one line without
// transformers: $MOETRAIN_HF_PYTHON, else /work/.venv-hf/bin/python, else python3).
#include <cstdlib>
#include <filesystem>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

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

const string kCteTemplate =
    "{{ bos_token }}{% for m in messages %}<tool>{{ m['role'] }}\n{{ m['content'] }}</tool>{% endfor %}"
    "{% if add_generation_prompt %}<tool>assistant\n{% endif %}";

string cte_transformers_python() {
  std::vector<string> candidates;
  if (const char* env = std::getenv("MOETRAIN_HF_PYTHON"); env && *env) candidates.push_back(env);
  candidates.push_back("/work/.venv-hf/bin/python");
  candidates.push_back("python3");
  for (const string& p : candidates)
    if ((p.find('/') == string::npos || fs::exists(p)) &&
        testing::run_command(testing::shell_quote(p) + " -c 'import transformers, jinja2' >/dev/null 2>&1") == 0)
      return p;
  return "";
}

}  // namespace

TEST_CASE("chat template export: the export carries the source's chat_template; AutoTokenizer applies it",
          "[cli][hf]") {
  TempDir tmp;
  const string src = tmp / "tok";
  fs::create_directories(src);
  testing::write_bytes(src + "/tokenizer.json",
                       testing::read_bytes(string(MOETRAIN_SOURCE_DIR) + "/tests/data/bpe/llama3_nfc.tokenizer.json"));
  testing::write_bytes(src + "/tokenizer_config.json",
                       nlohmann::json({{"chat_template", kCteTemplate},
                                       {"bos_token", "<|begin_of_text|>"},
                                       {"eos_token", "</tool>"}})
                           .dump());
  // A tiny GPT-2 model directory as `train` writes it, with data.tokenizer = the directory's tokenizer.json.
  ModelSource source;
  source.config_path = string(MOETRAIN_SOURCE_DIR) + "/configs/gpt2-shakespeare.yaml";
  source.overrides = {"model.n_layer=1", "model.n_head=2", "model.d_model=16", "model.n_ctx=32",
                      "model.vocab_size=704", "train.seq_len=16", "data.tokenizer=" + src + "/tokenizer.json"};
  Config config = resolve_config(source);
  std::unique_ptr<LanguageModel> model = build_model(config);
  export_model(*model, tmp / "model");
  config.save(tmp / "model/config.resolved.yaml");

  const testing::CommandOutput r =
      testing::run_moetrain("export --checkpoint " + tmp / "model" + " --out " + tmp / "out" + " --no-progress");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const nlohmann::json exported = nlohmann::json::parse(testing::read_bytes(tmp / "out/tokenizer_config.json"));
  CHECK(exported["chat_template"] == kCteTemplate);
  CHECK(exported["bos_token"] == "<|begin_of_text|>");
  CHECK(exported["eos_token"] == "</tool>");

  const string python = cte_transformers_python();
  if (python.empty()) {
    WARN("skipped AutoTokenizer.apply_chat_template on the export: no Python with transformers and jinja2 (set "
         "MOETRAIN_HF_PYTHON)");
    return;
  }
  testing::write_bytes(tmp / "apply.py", R"(import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
messages = [{"role": "user", "content": "Good morrow, cafe\u0301!"}, {"role": "assistant", "content": "Well met."}]
text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
if not isinstance(ids, list):
    ids = ids["input_ids"]
print(json.dumps({"text": text, "ids": list(ids), "bos": tok.bos_token, "eos": tok.eos_token}))
)");
  const testing::CommandOutput py = testing::capture_command(testing::shell_quote(python) + " " + tmp / "apply.py " +
                                                             tmp / "out 2>" + tmp / "apply.err");
  INFO(py.output << testing::read_bytes(tmp / "apply.err"));
  REQUIRE(py.code == 0);
  const nlohmann::json got = nlohmann::json::parse(py.output.substr(py.output.rfind("{\"text\"")));
  const string want_text =
      "<|begin_of_text|><tool>user\nGood morrow, caf\x65\xCC\x81!</tool><tool>assistant\nWell met.</tool><tool>assistant\n";
  CHECK(got["text"] == want_text);
  CHECK(got["bos"] == "<|begin_of_text|>");
  CHECK(got["eos"] == "</tool>");
  // The rendered text's ids: moetrain's tokenizer gives transformers' (the special tokens in it included).
  const auto tok = data::make_tokenizer(src + "/tokenizer.json", "");
  const std::vector<int32_t> ids = tok->encode(want_text);
  CHECK(got["ids"].get<std::vector<int32_t>>() == ids);
  CHECK(ids.front() == 700);
}
