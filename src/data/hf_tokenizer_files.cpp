// Tokenizer files for exports (hf_tokenizer_files.h).
#include "data/hf_tokenizer_files.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe.h"
#include "data/tiktoken.h"
#include "data/tokenizer_json.h"
#include "io/paths.h"

namespace moetrain::data {

namespace {

using nlohmann::json;
using nlohmann::ordered_json;

std::string hftf_quote(std::string_view s) { return json(std::string(s)).dump(); }

ordered_json hftf_added_token(const std::string& content, int32_t id, bool special, bool normalized) {
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false},  {"normalized", normalized}, {"special", special}};
}

// TemplateProcessing putting `prefix` before and `suffix` after the text (prepare's
// document tokens); null when both are empty.
ordered_json hftf_template(const std::vector<std::pair<std::string, int32_t>>& prefix,
                           const std::vector<std::pair<std::string, int32_t>>& suffix) {
  if (prefix.empty() && suffix.empty()) return nullptr;
  auto side = [&](const std::string& seq) {
    ordered_json items = ordered_json::array();
    for (const auto& [content, id] : prefix) items.push_back({{"SpecialToken", {{"id", content}, {"type_id", 0}}}});
    items.push_back({{"Sequence", {{"id", seq}, {"type_id", 0}}}});
    for (const auto& [content, id] : suffix) items.push_back({{"SpecialToken", {{"id", content}, {"type_id", 0}}}});
    return items;
  };
  ordered_json pair = side("A");
  for (const ordered_json& item : side("B")) pair.push_back(item);
  ordered_json specials = ordered_json::object();
  for (const auto* list : {&prefix, &suffix})
    for (const auto& [content, id] : *list)
      specials[content] = {{"id", content}, {"ids", {id}}, {"tokens", {content}}};
  return {{"type", "TemplateProcessing"}, {"single", side("A")}, {"pair", pair}, {"special_tokens", specials}};
}

// A tokenizer.json: `head` holds every field but "model", which is written after it
// from `vocab` (token string, id) and `merges` ("left right"), in the order given
// (a JSON library's object of 200,000 keys would sort or search them).
std::string hftf_tokenizer_json(const ordered_json& head, bool ignore_merges,
                                const std::vector<std::pair<std::string, int32_t>>& vocab,
                                const std::vector<std::string>& merges) {
  std::string out = head.dump(2);
  MT_ASSERT(out.size() >= 2 && out.back() == '}', "tokenizer.json head must be a JSON object");
  out.pop_back();
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  out += ",\n  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n"
         "    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n    \"fuse_unk\": false,\n"
         "    \"byte_fallback\": false,\n    \"ignore_merges\": ";
  out += ignore_merges ? "true" : "false";
  out += ",\n    \"vocab\": {";
  for (size_t i = 0; i < vocab.size(); ++i) {
    out += i == 0 ? "\n      " : ",\n      ";
    out += hftf_quote(vocab[i].first);
    out += ": ";
    out += std::to_string(vocab[i].second);
  }
  out += "\n    },\n    \"merges\": [";
  for (size_t i = 0; i < merges.size(); ++i) {
    out += i == 0 ? "\n      " : ",\n      ";
    out += hftf_quote(merges[i]);
  }
  out += merges.empty() ? "]\n  }\n}\n" : "\n    ]\n  }\n}\n";
  return out;
}

ordered_json hftf_head() {
  return {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", ordered_json::array()},
          {"normalizer", nullptr}, {"pre_tokenizer", nullptr}, {"post_processor", nullptr}, {"decoder", nullptr}};
}

ordered_json hftf_byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

// bos: the first token before a document; eos: the last one after it, else a usual
// end-of-text token among the added ones, else the end-of-text token.
std::string hftf_config(const std::vector<std::string>& prefix, const std::vector<std::string>& suffix,
                        const std::vector<std::string>& added, const std::optional<std::string>& eot) {
  ordered_json c = {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"clean_up_tokenization_spaces", false}};
  if (!prefix.empty()) c["bos_token"] = prefix.front();
  std::optional<std::string> eos;
  if (!suffix.empty()) eos = suffix.back();
  for (const char* usual : {"<|endoftext|>", "<|end_of_text|>", "</s>"})
    if (!eos && std::find(added.begin(), added.end(), usual) != added.end()) eos = usual;
  if (!eos) eos = eot;
  if (eos) c["eos_token"] = *eos;
  return c.dump(2) + "\n";
}

std::vector<HfTokenizerFile> hftf_byte() {
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (int b = 0; b < 256; ++b) vocab.emplace_back(byte_level_encode(std::string(1, static_cast<char>(b))), b);
  ordered_json head = hftf_head();
  head["pre_tokenizer"] = hftf_byte_level(false);
  head["decoder"] = hftf_byte_level(true);
  return {{"tokenizer.json", hftf_tokenizer_json(head, false, vocab, {})},
          {"tokenizer_config.json", hftf_config({}, {}, {}, std::nullopt)}};
}

std::vector<HfTokenizerFile> hftf_gpt2(const std::string& dir) {
  const Gpt2Tokenizer check(dir);  // the files as moetrain reads them, or an Error naming the file
  const std::string encoder_path = dir + "/encoder.json", merges_path = dir + "/vocab.bpe";
  const json encoder = json::parse(read_regular_file(encoder_path, "GPT-2's encoder.json", int64_t{64} << 20));
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(encoder.size());
  for (const auto& [key, value] : encoder.items()) vocab.emplace_back(key, value.get<int32_t>());
  std::sort(vocab.begin(), vocab.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  const std::string text = read_regular_file(merges_path, "GPT-2's vocab.bpe", int64_t{64} << 20);
  std::vector<std::string> merges;
  for (size_t pos = text.find('\n') + 1; pos < text.size();) {  // after "#version: 0.2"
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) merges.push_back(std::move(line));
  }
  ordered_json head = hftf_head();
  const std::optional<int32_t> eot = check.eot_token();
  std::vector<std::string> around;
  if (eot) {
    head["added_tokens"].push_back(hftf_added_token("<|endoftext|>", *eot, true, true));
    head["post_processor"] = hftf_template({{"<|endoftext|>", *eot}}, {});
    around.push_back("<|endoftext|>");
  }
  head["pre_tokenizer"] = hftf_byte_level(true);
  head["decoder"] = hftf_byte_level(true);
  return {{"tokenizer.json", hftf_tokenizer_json(head, false, vocab, merges)},
          {"tokenizer_config.json", hftf_config(around, {}, around, around.empty() ? std::nullopt
                                                                                  : std::optional(around[0]))}};
}

// A tiktoken spec (data/tiktoken.h): one Split step, raw byte tokens, ignore_merges.
std::string hftf_tiktoken_json(const BpeSpec& spec) {
  MT_ASSERT(spec.steps.size() == 1 && spec.steps[0].kind == BpeSpec::Step::Kind::split &&
                spec.steps[0].behavior == SplitBehavior::removed && spec.steps[0].invert && spec.ignore_merges &&
                !spec.nfc,
            "a tiktoken spec has one Split step (Removed, invert) and ignore_merges");
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (size_t id = 0; id < spec.tokens.size(); ++id)
    if (spec.has_token[id] && spec.mergeable[id])
      vocab.emplace_back(byte_level_encode(spec.tokens[id]), static_cast<int32_t>(id));
  // HF merges are strictly ordered; tiktoken's splits of one token share its rank.
  // Among them, by the ranks of the left and then the right part (transformers'
  // TikTokenConverter order); two splits of one token never compete in a piece.
  std::vector<BpeSpec::Merge> sorted = spec.merges;
  std::sort(sorted.begin(), sorted.end(), [](const BpeSpec::Merge& a, const BpeSpec::Merge& b) {
    return std::tie(a.rank, a.left, a.right) < std::tie(b.rank, b.left, b.right);
  });
  std::vector<std::string> merges;
  merges.reserve(sorted.size());
  for (const BpeSpec::Merge& m : sorted)
    merges.push_back(byte_level_encode(spec.tokens[m.left]) + " " + byte_level_encode(spec.tokens[m.right]));
  ordered_json head = hftf_head();
  std::vector<BpeSpec::Added> added = spec.added;
  std::sort(added.begin(), added.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  for (const BpeSpec::Added& a : added) head["added_tokens"].push_back(hftf_added_token(a.content, a.id, true, false));
  ordered_json split = {{"type", "Split"},
                        {"pattern", {{"Regex", spec.steps[0].source_pattern}}},
                        {"behavior", "Removed"},
                        {"invert", true}};
  head["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {split, hftf_byte_level(false)}}};
  auto named = [&](const std::vector<int32_t>& ids) {
    std::vector<std::pair<std::string, int32_t>> out;
    for (int32_t id : ids) out.emplace_back(spec.tokens[id], id);
    return out;
  };
  head["post_processor"] = hftf_template(named(spec.document_prefix), named(spec.document_suffix));
  head["decoder"] = hftf_byte_level(true);
  return hftf_tokenizer_json(head, true, vocab, merges);
}

std::string hftf_spec_config(const BpeSpec& spec) {
  auto contents = [&](const std::vector<int32_t>& ids) {
    std::vector<std::string> out;
    for (int32_t id : ids) out.push_back(spec.tokens[id]);
    return out;
  };
  std::vector<std::string> added;
  for (const BpeSpec::Added& a : spec.added)
    if (a.special) added.push_back(a.content);
  std::optional<std::string> eot;
  if (spec.eot) eot = spec.tokens[*spec.eot];
  return hftf_config(contents(spec.document_prefix), contents(spec.document_suffix), added, eot);
}

// The token text a tokenizer_config.json gives for `key`: a string or an AddedToken
// object ({"content": ...}); nullopt when absent or null.
std::optional<std::string> hftf_declared_token(const std::string& file, const json& c, const char* key) {
  if (!c.contains(key) || c[key].is_null()) return std::nullopt;
  const json& v = c[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  MT_THROW("{}: {} is {}; expected a token's text or {{\"content\": text, ...}}", file, key, v.dump().substr(0, 80));
}

// The source's tokenizer_config.json (and chat_template.jinja) beside the tokenizer
// file, in the Hugging Face layout: its chat_template and the bos/eos tokens it
// declares replace those of `config` (the export's tokenizer_config.json).
void hftf_carry_source_config(const std::string& tokenizer_path, const BpeSpec& spec, std::string& config) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(tokenizer_path).parent_path();
  const fs::path config_path = dir / "tokenizer_config.json", jinja_path = dir / "chat_template.jinja";
  std::error_code ec;
  const bool have_config = fs::exists(config_path, ec), have_jinja = fs::exists(jinja_path, ec);
  if (!have_config && !have_jinja) return;
  ordered_json out = ordered_json::parse(config);
  std::optional<json> chat_template;
  if (have_config) {
    const std::string file = config_path.string();
    json c;
    try {
      c = json::parse(read_regular_file(file, "the tokenizer's tokenizer_config.json", int64_t{64} << 20));
    } catch (const json::exception& e) {
      MT_THROW("{}: not valid JSON ({}); expected the tokenizer's tokenizer_config.json (its chat_template and "
               "bos/eos tokens go into the export: docs/export.md#tokenizer-files)",
               file, e.what());
    }
    MT_CHECK(c.is_object(), "{}: not a JSON object; expected the tokenizer's tokenizer_config.json", file);
    if (c.contains("chat_template") && !c["chat_template"].is_null()) {
      const json& t = c["chat_template"];
      bool ok = t.is_string();
      if (t.is_array()) {
        ok = !t.empty();
        for (const json& item : t)
          ok = ok && item.is_object() && item.contains("name") && item["name"].is_string() &&
               item.contains("template") && item["template"].is_string();
      }
      MT_CHECK(ok, "{}: chat_template is {}; expected a Jinja template (a string) or a list of {{\"name\", "
                   "\"template\"}} objects, as transformers reads it",
               file, t.dump().substr(0, 80));
      chat_template = t;
    }
    for (const char* key : {"bos_token", "eos_token"}) {
      const std::optional<std::string> token = hftf_declared_token(file, c, key);
      if (!token) continue;
      bool known = false;
      for (size_t id = 0; id < spec.tokens.size() && !known; ++id) known = spec.has_token[id] && spec.tokens[id] == *token;
      MT_CHECK(known,
               "{}: {} \"{}\" is no token of {}; transformers would add it as a new id past the model's vocabulary "
               "(fix {} or the tokenizer)",
               file, key, *token, tokenizer_path, key);
      out[key] = *token;
    }
  }
  if (have_jinja) {
    const std::string jinja = read_regular_file(jinja_path.string(), "the tokenizer's chat_template.jinja", int64_t{16} << 20);
    MT_CHECK(!chat_template || (chat_template->is_string() && chat_template->get<std::string>() == jinja),
             "{} and the chat_template of {} differ; keep one of them", jinja_path.string(), config_path.string());
    chat_template = jinja;
  }
  if (chat_template) out["chat_template"] = *chat_template;
  config = out.dump(2) + "\n";
}

}  // namespace

std::vector<HfTokenizerFile> hf_tokenizer_files(std::string_view name, const std::string& tokenizer_dir) {
  if (name == "byte") return hftf_byte();
  if (name == "gpt2") return hftf_gpt2(tokenizer_dir);
  const std::string path(name);
  make_tokenizer(name, tokenizer_dir);  // as training reads it, or the Error naming file and field
  const std::string text = read_regular_file(path, "a tokenizer file", int64_t{1} << 30);
  const size_t first = text.find_first_not_of(" \t\r\n");
  std::vector<HfTokenizerFile> files;
  BpeSpec spec;
  if (first == std::string::npos || text[first] != '{') {
    spec = read_tiktoken(path, text, path + ".json");
    files = {{"tokenizer.json", hftf_tiktoken_json(spec)}, {"tokenizer_config.json", hftf_spec_config(spec)}};
  } else {
    const json j = json::parse(text);
    if (j.contains("model")) {
      // The file itself: transformers reads every field moetrain does (and more).
      spec = read_tokenizer_json(path, j);
      files = {{"tokenizer.json", text}, {"tokenizer_config.json", hftf_spec_config(spec)}};
    } else {
      spec = read_tiktoken_description(path, j);
      files = {{"tokenizer.json", hftf_tiktoken_json(spec)}, {"tokenizer_config.json", hftf_spec_config(spec)}};
    }
  }
  hftf_carry_source_config(path, spec, files[1].text);
  return files;
}

}  // namespace moetrain::data
