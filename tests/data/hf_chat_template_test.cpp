// The chat template of a Hugging Face tokenizer directory carried into an
// export's tokenizer_config.json (data/hf_tokenizer_files.h): chat_template and
// the bos/eos tokens that the source's tokenizer_config.json declares (or a
// chat_template.jinja beside it); what transformers could not use is refused
// naming the file and the field. transformers' apply_chat_template on an
// export: tests/cli/chat_template_export_test.cpp.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/hf_tokenizer_files.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data_testing;

namespace {

const std::string kHctFixtures = kSourceDir + "/tests/data/bpe";
const std::string kHctTemplate =
    "{{ bos_token }}{% for m in messages %}<tool>{{ m['role'] }}\n{{ m['content'] }}</tool>{% endfor %}";

// `dir`/tokenizer.json (the Llama-3-style fixture) and, if given, tokenizer_config.json.
std::string hct_source(const TempDir& tmp, const std::string& name, const std::string& config) {
  const std::string dir = tmp / name;
  std::filesystem::create_directories(dir);
  write_bytes(dir + "/tokenizer.json", read_bytes(kHctFixtures + "/llama3_nfc.tokenizer.json"));
  if (!config.empty()) write_bytes(dir + "/tokenizer_config.json", config);
  return dir + "/tokenizer.json";
}

nlohmann::json hct_export_config(const std::string& tokenizer) {
  for (const auto& f : data::hf_tokenizer_files(tokenizer, ""))
    if (f.name == "tokenizer_config.json") return nlohmann::json::parse(f.text);
  FAIL("no tokenizer_config.json");
  return {};
}

}  // namespace

TEST_CASE("chat template: the source's chat_template and bos/eos go into the export's tokenizer_config.json",
          "[data][tokenizer]") {
  TempDir tmp;
  // Without a tokenizer_config.json beside it: no chat_template, the document tokens' bos/eos.
  const nlohmann::json plain = hct_export_config(hct_source(tmp, "plain", ""));
  CHECK_FALSE(plain.contains("chat_template"));
  CHECK(plain["bos_token"] == "<|begin_of_text|>");
  CHECK(plain["eos_token"] == "<|end_of_text|>");

  // A string template and AddedToken-style bos/eos: carried, eos replaced by the declared one.
  const nlohmann::json source = {{"chat_template", kHctTemplate},
                                 {"bos_token", {{"__type", "AddedToken"}, {"content", "<|begin_of_text|>"}}},
                                 {"eos_token", "</tool>"},
                                 {"model_max_length", 8192}};
  const nlohmann::json c = hct_export_config(hct_source(tmp, "chat", source.dump()));
  CHECK(c["chat_template"] == kHctTemplate);
  CHECK(c["bos_token"] == "<|begin_of_text|>");
  CHECK(c["eos_token"] == "</tool>");
  CHECK(c["tokenizer_class"] == "PreTrainedTokenizerFast");
  CHECK_FALSE(c.contains("model_max_length"));  // only the template and bos/eos are carried

  // A list of named templates, as transformers also saves them.
  const nlohmann::json named = {{"chat_template", {{{"name", "default"}, {"template", kHctTemplate}},
                                                   {{"name", "tool_use"}, {"template", "{{ messages }}"}}}}};
  CHECK(hct_export_config(hct_source(tmp, "named", named.dump()))["chat_template"] == named["chat_template"]);

  // chat_template.jinja beside it (transformers' newer layout).
  const std::string jinja_tok = hct_source(tmp, "jinja", "");
  write_bytes(tmp / "jinja/chat_template.jinja", kHctTemplate);
  CHECK(hct_export_config(jinja_tok)["chat_template"] == kHctTemplate);
}

TEST_CASE("chat template: what transformers could not use is refused naming the file and field",
          "[data][tokenizer][errors]") {
  TempDir tmp;
  const std::string dir = tmp.path();
  CHECK_THROWS_WITH(data::hf_tokenizer_files(hct_source(tmp, "a", "{\"chat_template\": 7}"), ""),
                    Catch::Contains(dir + "/a/tokenizer_config.json: chat_template is 7; expected a Jinja template"));
  CHECK_THROWS_WITH(
      data::hf_tokenizer_files(hct_source(tmp, "b", "{\"chat_template\": [{\"name\": \"x\"}]}"), ""),
      Catch::Contains(dir + "/b/tokenizer_config.json: chat_template is"));
  CHECK_THROWS_WITH(data::hf_tokenizer_files(hct_source(tmp, "c", "{\"eos_token\": \"<|im_end|>\"}"), ""),
                    Catch::Contains(dir + "/c/tokenizer_config.json: eos_token \"<|im_end|>\" is no token of " + dir +
                                    "/c/tokenizer.json"));
  CHECK_THROWS_WITH(data::hf_tokenizer_files(hct_source(tmp, "d", "{\"bos_token\": 3}"), ""),
                    Catch::Contains(dir + "/d/tokenizer_config.json: bos_token is 3"));
  CHECK_THROWS_WITH(data::hf_tokenizer_files(hct_source(tmp, "e", "{\"chat_template\": \"x\""), ""),
                    Catch::Contains(dir + "/e/tokenizer_config.json: not valid JSON"));
  const std::string both = hct_source(tmp, "f", nlohmann::json({{"chat_template", "one"}}).dump());
  write_bytes(tmp / "f/chat_template.jinja", "two");
  CHECK_THROWS_WITH(data::hf_tokenizer_files(both, ""),
                    Catch::Contains("chat_template.jinja and the chat_template of") && Catch::Contains("differ"));
}
