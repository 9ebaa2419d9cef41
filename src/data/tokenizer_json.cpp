// tokenizer.json -> BpeSpec (what is read and what is refused: tokenizer_json.h).
// Field names in messages are the JSON paths ("pre_tokenizer.pretokenizers[1].behavior").
#include "data/tokenizer_json.h"

#include <algorithm>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain::data {

namespace {

using nlohmann::json;

// Loader state: the file and how to name its fields.
struct JsonReader {
  const std::string& path;

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    MT_THROW("{}: {} {}", path, field, what);
  }
  [[noreturn]] void refuse(const std::string& field, const std::string& value, const std::string& why) const {
    MT_THROW("{}: {} is {}; {} (moetrain reads the byte-level BPE family exactly and refuses what it cannot "
             "reproduce: docs/training.md#tokenizers)",
             path, field, value, why);
  }
  const json* get(const json& obj, const std::string& key) const {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  bool flag(const json& obj, const std::string& key, const std::string& field, bool def) const {
    const json* v = get(obj, key);
    if (v == nullptr) return def;
    if (!v->is_boolean()) fail(field + "." + key, fmt::format("is {}; expected true or false", v->dump()));
    return v->get<bool>();
  }
  std::string text(const json& obj, const std::string& key, const std::string& field) const {
    const json* v = get(obj, key);
    if (v == nullptr || !v->is_string()) fail(field + "." + key, "is missing or not a string");
    return v->get<std::string>();
  }
  std::string type(const json& obj, const std::string& field) const {
    if (!obj.is_object()) fail(field, fmt::format("is {}; expected an object with a \"type\"", obj.dump()));
    return text(obj, "type", field);
  }
};

// The string of `s` for a regex: PCRE2 escapes of everything but letters and digits.
std::string tj_regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

void tj_read_pre_tokenizer(const JsonReader& r, const json& p, const std::string& field, BpeSpec& spec) {
  const std::string type = r.type(p, field);
  if (type == "Sequence") {
    const json* list = r.get(p, "pretokenizers");
    if (list == nullptr || !list->is_array()) r.fail(field + ".pretokenizers", "is missing or not a list");
    for (size_t i = 0; i < list->size(); ++i)
      tj_read_pre_tokenizer(r, (*list)[i], fmt::format("{}.pretokenizers[{}]", field, i), spec);
    return;
  }
  if (!spec.steps.empty() && spec.steps.back().kind == BpeSpec::Step::Kind::byte_level)
    r.refuse(field + ".type", "\"" + type + "\" after ByteLevel",
             "a step after ByteLevel sees its byte alphabet, not the text; ByteLevel must be the last step");
  BpeSpec::Step step;
  step.where = fmt::format("{}: {}", r.path, field);
  if (type == "ByteLevel") {
    step.kind = BpeSpec::Step::Kind::byte_level;
    step.add_prefix_space = r.flag(p, "add_prefix_space", field, true);
    step.use_regex = r.flag(p, "use_regex", field, true);
  } else if (type == "Split") {
    const json* pattern = r.get(p, "pattern");
    if (pattern == nullptr || !pattern->is_object() || pattern->size() != 1)
      r.fail(field + ".pattern", "is missing or not {\"Regex\": ...} / {\"String\": ...}");
    if (pattern->contains("Regex")) {
      const json& re = (*pattern)["Regex"];
      if (!re.is_string()) r.fail(field + ".pattern.Regex", "is not a string");
      step.where += ".pattern.Regex";
      step.pattern = translate_split_pattern(re.get<std::string>(), step.where);
    } else if (pattern->contains("String")) {
      const json& str = (*pattern)["String"];
      if (!str.is_string() || str.get<std::string>().empty()) r.fail(field + ".pattern.String", "is not a non-empty string");
      step.where += ".pattern.String";
      step.pattern = tj_regex_escape(str.get<std::string>());
    } else {
      r.refuse(field + ".pattern", pattern->dump(), "the pattern is {\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string behavior = r.text(p, "behavior", field);
    static const std::unordered_map<std::string, SplitBehavior> behaviors = {
        {"Isolated", SplitBehavior::isolated},
        {"Removed", SplitBehavior::removed},
        {"MergedWithPrevious", SplitBehavior::merged_with_previous},
        {"MergedWithNext", SplitBehavior::merged_with_next},
        {"Contiguous", SplitBehavior::contiguous}};
    auto it = behaviors.find(behavior);
    if (it == behaviors.end())
      r.refuse(field + ".behavior", "\"" + behavior + "\"",
               "the split behaviours are Isolated, Removed, MergedWithPrevious, MergedWithNext and Contiguous");
    step.behavior = it->second;
    step.invert = r.flag(p, "invert", field, false);
  } else {
    r.refuse(field + ".type", "\"" + type + "\"",
             "the pre-tokenizers of the byte-level BPE family are ByteLevel, Split and Sequence");
  }
  spec.steps.push_back(std::move(step));
}

void tj_read_normalizer(const JsonReader& r, const json& n, const std::string& field, BpeSpec& spec) {
  const std::string type = r.type(n, field);
  if (type == "NFC") {
    spec.nfc = true;
  } else if (type == "Sequence") {
    const json* list = r.get(n, "normalizers");
    if (list == nullptr || !list->is_array()) r.fail(field + ".normalizers", "is missing or not a list");
    for (size_t i = 0; i < list->size(); ++i)
      tj_read_normalizer(r, (*list)[i], fmt::format("{}.normalizers[{}]", field, i), spec);
  } else {
    r.refuse(field + ".type", "\"" + type + "\"", "the normalizers read are NFC (utf8proc) and none");
  }
}

void tj_read_post_processor(const JsonReader& r, const json& p, const std::string& field, BpeSpec& spec,
                            bool& have_template) {
  const std::string type = r.type(p, field);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json* list = r.get(p, "processors");
    if (list == nullptr || !list->is_array()) r.fail(field + ".processors", "is missing or not a list");
    for (size_t i = 0; i < list->size(); ++i)
      tj_read_post_processor(r, (*list)[i], fmt::format("{}.processors[{}]", field, i), spec, have_template);
    return;
  }
  if (type != "TemplateProcessing")
    r.refuse(field + ".type", "\"" + type + "\"",
             "the post-processors read are TemplateProcessing, ByteLevel and a Sequence of them");
  if (have_template) r.refuse(field, "a second TemplateProcessing", "one template sets the document's tokens");
  have_template = true;
  const json* single = r.get(p, "single");
  const json* specials = r.get(p, "special_tokens");
  if (single == nullptr || !single->is_array()) r.fail(field + ".single", "is missing or not a list");
  bool seen_a = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const json& item = (*single)[i];
    const std::string where = fmt::format("{}.single[{}]", field, i);
    if (item.is_object() && item.contains("Sequence")) {
      const std::string id = r.text(item["Sequence"], "id", where + ".Sequence");
      if (id != "A" || seen_a) r.refuse(where + ".Sequence.id", "\"" + id + "\"", "a single template holds $A once");
      seen_a = true;
    } else if (item.is_object() && item.contains("SpecialToken")) {
      const std::string name = r.text(item["SpecialToken"], "id", where + ".SpecialToken");
      if (specials == nullptr || !specials->contains(name) || !(*specials)[name].contains("ids") ||
          !(*specials)[name]["ids"].is_array())
        r.fail(where + ".SpecialToken.id", fmt::format("\"{}\" is not in {}.special_tokens with its ids", name, field));
      for (const json& id : (*specials)[name]["ids"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())
          r.fail(fmt::format("{}.special_tokens.{}.ids", field, name), fmt::format("holds {}; ids are integers >= 0", id.dump()));
        (seen_a ? spec.document_suffix : spec.document_prefix).push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
    } else {
      r.fail(where, fmt::format("is {}; expected {{\"SpecialToken\": ...}} or {{\"Sequence\": ...}}", item.dump()));
    }
  }
  if (!seen_a) r.fail(field + ".single", "has no $A (the text)");
}

void tj_read_decoder(const JsonReader& r, const json& d, const std::string& field) {
  const std::string type = r.type(d, field);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json* list = r.get(d, "decoders");
    if (list == nullptr || !list->is_array()) r.fail(field + ".decoders", "is missing or not a list");
    for (size_t i = 0; i < list->size(); ++i) tj_read_decoder(r, (*list)[i], fmt::format("{}.decoders[{}]", field, i));
    return;
  }
  r.refuse(field + ".type", "\"" + type + "\"", "the decoder of the byte-level family is ByteLevel");
}

}  // namespace

BpeSpec read_tokenizer_json(const std::string& path, const json& j) {
  JsonReader r{path};
  BpeSpec spec;
  spec.name = path;
  spec.source = path;
  if (!j.is_object()) r.fail("(the file)", "is not a JSON object");
  for (const char* key : {"truncation", "padding"})
    if (const json* v = r.get(j, key))
      r.refuse(key, v->dump().substr(0, 80), fmt::format("set it to null: prepare tokenizes whole documents", key));

  // model
  const json* model = r.get(j, "model");
  if (model == nullptr) r.fail("model", "is missing");
  const std::string type = model->is_object() && model->contains("type") ? r.type(*model, "model") : "BPE";
  if (type != "BPE") r.refuse("model.type", "\"" + type + "\"", "the engine is BPE (WordPiece, Unigram and WordLevel are not)");
  if (r.flag(*model, "byte_fallback", "model", false))
    r.refuse("model.byte_fallback", "true", "byte fallback belongs to SentencePiece-style BPE, not the byte-level family");
  if (const json* d = r.get(*model, "dropout"); d != nullptr && !(d->is_number() && d->get<double>() == 0.0))
    r.refuse("model.dropout", d->dump(), "BPE dropout is random; set it to null");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = r.get(*model, key); v != nullptr && !(v->is_string() && v->get<std::string>().empty()))
      r.refuse(std::string("model.") + key, v->dump(), "the byte-level family has none; set it to null");
  spec.ignore_merges = r.flag(*model, "ignore_merges", "model", false);

  const json* vocab = r.get(*model, "vocab");
  if (vocab == nullptr || !vocab->is_object() || vocab->empty())
    r.fail("model.vocab", "is missing or not an object of token strings to ids");
  std::unordered_map<std::string, int32_t> id_of;
  id_of.reserve(vocab->size());
  int64_t max_id = -1;
  for (const auto& [token, value] : vocab->items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= (int64_t{1} << 31) - 1)
      r.fail("model.vocab", fmt::format("gives token \"{}\" the id {}; ids are integers in [0, 2^31 - 1)", token, value.dump()));
    id_of.emplace(token, static_cast<int32_t>(value.get<int64_t>()));
    max_id = std::max(max_id, value.get<int64_t>());
  }
  const json* added = r.get(j, "added_tokens");
  if (added != nullptr && !added->is_array()) r.fail("added_tokens", "is not a list");
  if (added != nullptr)
    for (size_t i = 0; i < added->size(); ++i) {
      const json& a = (*added)[i];
      const json* id = a.is_object() ? r.get(a, "id") : nullptr;
      if (id == nullptr || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() >= (int64_t{1} << 31) - 1)
        r.fail(fmt::format("added_tokens[{}].id", i), "is missing or not an integer in [0, 2^31 - 1)");
      max_id = std::max(max_id, id->get<int64_t>());
    }
  const auto vocab_size = static_cast<size_t>(max_id + 1);
  spec.tokens.assign(vocab_size, {});
  spec.has_token.assign(vocab_size, false);
  spec.mergeable.assign(vocab_size, false);
  std::vector<std::string> names(vocab_size);  // for messages
  for (const auto& [token, id] : id_of) {
    if (spec.has_token[id])
      r.fail("model.vocab", fmt::format("gives the id {} to two tokens, \"{}\" and \"{}\"", id, names[id], token));
    spec.has_token[id] = true;
    names[id] = token;
    std::optional<std::string> bytes = byte_level_decode(token);
    spec.mergeable[id] = bytes.has_value() && !bytes->empty();
    spec.tokens[id] = bytes.value_or(token);  // the ByteLevel decoder gives other tokens' own UTF-8
  }

  // merges, in rank order
  const json* merges = r.get(*model, "merges");
  if (merges == nullptr || !merges->is_array()) r.fail("model.merges", "is missing or not a list");
  spec.merges.reserve(merges->size());
  std::unordered_set<uint64_t> seen;
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& m = (*merges)[i];
    const std::string field = fmt::format("model.merges[{}]", i);
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        r.fail(field, fmt::format("is \"{}\"; expected \"left right\" (two tokens and one space)", s));
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      r.fail(field, fmt::format("is {}; expected \"left right\" or [\"left\", \"right\"]", m.dump()));
    }
    auto a = id_of.find(left), b = id_of.find(right), ab = id_of.find(left + right);
    for (auto [it, what] : {std::pair{a, left}, std::pair{b, right}, std::pair{ab, left + right}})
      if (it == id_of.end()) r.fail(field, fmt::format("merges \"{}\" and \"{}\", but \"{}\" is not in model.vocab", left, right, what));
    const uint64_t key = (static_cast<uint64_t>(a->second) << 32) | static_cast<uint32_t>(b->second);
    if (!seen.insert(key).second) r.fail(field, fmt::format("merges \"{}\" and \"{}\" a second time", left, right));
    spec.merges.push_back({a->second, b->second, ab->second, static_cast<int32_t>(i)});
  }

  // normalizer, pre-tokenizer
  if (const json* n = r.get(j, "normalizer")) tj_read_normalizer(r, *n, "normalizer", spec);
  const json* pre = r.get(j, "pre_tokenizer");
  if (pre == nullptr) r.refuse("pre_tokenizer", "null", "the byte-level family needs a ByteLevel pre-tokenizer");
  tj_read_pre_tokenizer(r, *pre, "pre_tokenizer", spec);
  if (spec.steps.empty() || spec.steps.back().kind != BpeSpec::Step::Kind::byte_level)
    r.refuse("pre_tokenizer", fmt::format("{}", pre->dump().substr(0, 80)),
             "the byte-level family ends its pre-tokenizer with ByteLevel, which maps bytes to the vocabulary's alphabet");

  // added tokens. HF's loader does not take their ids from the file: a token
  // of the model's vocab keeps its id there, any other gets the next id after
  // the vocab's size (its number of tokens) and the added ones so far
  // (AddedVocabulary::add_tokens). A file whose ids say otherwise is refused.
  int64_t max_added = -1;
  if (added != nullptr)
    for (size_t i = 0; i < added->size(); ++i) {
      const json& a = (*added)[i];
      const std::string field = fmt::format("added_tokens[{}]", i);
      BpeSpec::Added t;
      t.id = static_cast<int32_t>(a["id"].get<int64_t>());
      {
        const std::string content = r.text(a, "content", field);
        auto in_vocab = id_of.find(content);
        const auto vocab_len = static_cast<int64_t>(id_of.size());
        const int64_t hf_id = in_vocab != id_of.end() ? in_vocab->second
                              : max_added < 0       ? vocab_len
                              : max_added >= vocab_len ? max_added + 1
                                                       : vocab_len;
        max_added = std::max(max_added, hf_id);
        if (hf_id != t.id)
          r.fail(field + ".id", fmt::format("is {}, but HF tokenizers loads \"{}\" as id {} (a token of model.vocab "
                                            "keeps its vocab id; the others follow the {} vocab tokens in order); "
                                            "fix the ids",
                                            t.id, content, hf_id, id_of.size()));
      }
      t.content = r.text(a, "content", field);
      if (t.content.empty()) r.fail(field + ".content", "is empty");
      for (const char* key : {"single_word", "lstrip", "rstrip"})
        if (r.flag(a, key, field, false))
          r.refuse(field + "." + key, "true", "added tokens are matched as they are; set it to false");
      t.special = r.flag(a, "special", field, false);
      t.normalized = r.flag(a, "normalized", field, !t.special);
      if (t.normalized && spec.nfc) t.content = nfc_normalize(t.content);
      // HF decodes an id as its added token first, through the ByteLevel decoder.
      spec.tokens[t.id] = byte_level_decode(t.content).value_or(t.content);
      spec.has_token[t.id] = true;
      spec.added.push_back(std::move(t));
    }

  // post-processor, decoder
  bool have_template = false;
  if (const json* p = r.get(j, "post_processor")) tj_read_post_processor(r, *p, "post_processor", spec, have_template);
  for (int32_t id : spec.document_prefix)
    if (static_cast<size_t>(id) >= vocab_size || !spec.has_token[id])
      r.fail("post_processor", fmt::format("puts the id {}, which no token has, around the text", id));
  for (int32_t id : spec.document_suffix)
    if (static_cast<size_t>(id) >= vocab_size || !spec.has_token[id])
      r.fail("post_processor", fmt::format("puts the id {}, which no token has, around the text", id));
  const json* decoder = r.get(j, "decoder");
  if (decoder == nullptr)
    r.refuse("decoder", "null", "without a decoder HF joins the token strings with spaces; the family uses ByteLevel");
  tj_read_decoder(r, *decoder, "decoder");

  // The end-of-text token: the template's first token, else "<|endoftext|>".
  if (!spec.document_prefix.empty()) spec.eot = spec.document_prefix.front();
  for (const BpeSpec::Added& a : spec.added)
    if (!spec.eot && a.content == "<|endoftext|>") spec.eot = a.id;
  if (!spec.eot && !spec.document_suffix.empty()) spec.eot = spec.document_suffix.back();
  if (spec.document_prefix.empty() && spec.document_suffix.empty() && spec.eot) spec.document_prefix.push_back(*spec.eot);
  return spec;
}

}  // namespace moetrain::data
