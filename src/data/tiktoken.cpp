// tiktoken rank file + description -> BpeSpec (formats in tiktoken.h).
#include "data/tiktoken.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/paths.h"

namespace moetrain::data {

namespace {

using nlohmann::json;

// Ids a rank file and its description may use: 2^24 (Kimi's 163,840 and o200k's 200,019
// are far below); a larger id would size the vocabulary tables by it (an id of 2e9: 64 GB).
constexpr int64_t kTtMaxIds = int64_t{1} << 24;

// Strict base64 (RFC 4648 alphabet, '=' padding), as Python's b64decode of tiktoken's files.
std::optional<std::string> tt_base64_decode(std::string_view s) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (s.empty() || s.size() % 4 != 0) return std::nullopt;
  size_t pad = 0;
  while (pad < 2 && s[s.size() - 1 - pad] == '=') ++pad;
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < s.size() - pad; ++i) {
    const int v = value(s[i]);
    if (v < 0) return std::nullopt;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

// The description's fields into `spec` (tokens and merges already read).
// `pattern_where` names where the pattern came from, for a pattern that does not compile.
void tt_read_description(const std::string& path, const json& j, BpeSpec& spec, const std::string& pattern_where) {
  auto fail = [&](const std::string& field, const std::string& what) -> void {
    MT_THROW("{}: {} {} (the tiktoken description: docs/training.md#tokenizers)", path, field, what);
  };
  if (!j.is_object()) fail("(the file)", "is not a JSON object");
  static const char* known[] = {"tiktoken", "pattern", "special_tokens", "document_prefix", "document_suffix",
                                "vocab_size"};
  for (const auto& [key, value] : j.items())
    if (std::find(std::begin(known), std::end(known), key) == std::end(known))
      fail(key, "is not a field of a tiktoken description (tiktoken, pattern, special_tokens, document_prefix, "
                "document_suffix, vocab_size)");
  if (!j.contains("pattern") || !j["pattern"].is_string() || j["pattern"].get<std::string>().empty())
    fail("pattern", "is missing or not a non-empty string: give tiktoken's pat_str");
  BpeSpec::Step step;
  step.kind = BpeSpec::Step::Kind::split;
  step.where = pattern_where;
  step.source_pattern = j["pattern"].get<std::string>();
  step.pattern = translate_split_pattern(step.source_pattern, step.where);
  step.behavior = SplitBehavior::removed;  // tiktoken keeps the matches only
  step.invert = true;
  spec.steps.push_back(std::move(step));

  std::unordered_map<std::string, int32_t> special_ids;
  int64_t max_id = static_cast<int64_t>(spec.tokens.size()) - 1;
  if (j.contains("special_tokens")) {
    const json& st = j["special_tokens"];
    if (!st.is_object()) fail("special_tokens", "is not an object of token texts to ids");
    for (const auto& [content, id] : st.items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kTtMaxIds)
        fail("special_tokens", fmt::format("gives \"{}\" the id {}; ids are integers in [0, {})", content, id.dump(),
                                           kTtMaxIds));
      if (content.empty()) fail("special_tokens", "holds an empty token");
      const auto i = static_cast<int32_t>(id.get<int64_t>());
      if (static_cast<size_t>(i) < spec.tokens.size() && spec.has_token[i])
        fail("special_tokens", fmt::format("gives \"{}\" the id {}, which the rank file gives a token", content, i));
      for (const auto& [other, other_id] : special_ids)
        if (other_id == i) fail("special_tokens", fmt::format("gives the id {} to \"{}\" and \"{}\"", i, other, content));
      special_ids.emplace(content, i);
      max_id = std::max<int64_t>(max_id, i);
    }
  }
  int64_t vocab_size = max_id + 1;
  if (j.contains("vocab_size")) {
    const json& v = j["vocab_size"];
    if (!v.is_number_integer() || v.get<int64_t>() < vocab_size || v.get<int64_t>() > kTtMaxIds)
      fail("vocab_size", fmt::format("is {}; it must be an integer of at least {} (the largest id + 1) and at most {}",
                                     v.dump(), vocab_size, kTtMaxIds));
    vocab_size = v.get<int64_t>();
  }
  spec.tokens.resize(static_cast<size_t>(vocab_size));
  spec.has_token.resize(static_cast<size_t>(vocab_size), false);
  spec.mergeable.resize(static_cast<size_t>(vocab_size), false);
  for (const auto& [content, id] : special_ids) {
    spec.tokens[id] = content;
    spec.has_token[id] = true;
    spec.added.push_back({content, id, /*special=*/true, /*normalized=*/false});
  }
  for (const char* key : {"document_prefix", "document_suffix"}) {
    if (!j.contains(key)) continue;
    const json& list = j[key];
    if (!list.is_array()) fail(key, "is not a list of special token texts");
    for (const json& name : list) {
      if (!name.is_string() || !special_ids.contains(name.get<std::string>()))
        fail(key, fmt::format("names {}, which is not in special_tokens", name.dump()));
      (std::string_view(key) == "document_prefix" ? spec.document_prefix : spec.document_suffix)
          .push_back(special_ids[name.get<std::string>()]);
    }
  }
  if (auto it = special_ids.find("<|endoftext|>"); it != special_ids.end()) spec.eot = it->second;
  if (!spec.document_prefix.empty()) spec.eot = spec.document_prefix.front();
  else if (!spec.eot && !spec.document_suffix.empty()) spec.eot = spec.document_suffix.back();
  if (spec.document_prefix.empty() && spec.document_suffix.empty() && spec.eot)
    spec.document_prefix.push_back(*spec.eot);
}


// The description `j` (of `path`; null when there is none) with the command
// line's `settings` added; a field both give differently is an Error naming
// the option and the file. Sets `pattern_where` to the pattern's origin.
json tt_merge_settings(const std::string& path, const json& j, const TiktokenSettings& settings,
                       std::string& pattern_where) {
  json merged = j.is_null() ? json::object() : j;
  pattern_where = path + ": pattern";
  if (settings.empty()) return merged;
  const std::string file = j.is_null() ? std::string() : path;
  if (!settings.pattern.empty()) {
    const std::string* preset = tiktoken_pattern_preset(settings.pattern);
    const std::string pattern = preset ? *preset : settings.pattern;
    if (!file.empty() && merged.is_object() && merged.contains("pattern") && merged["pattern"] != json(pattern))
      MT_THROW("--tiktoken-pattern {} differs from the pattern of {} ({}); give the pattern in one place only",
               settings.pattern, file, merged["pattern"].dump().substr(0, 120));
    merged["pattern"] = pattern;
    pattern_where = preset ? fmt::format("--tiktoken-pattern {}", settings.pattern) : "--tiktoken-pattern";
  }
  if (!settings.special_tokens.empty()) {
    json& st = merged["special_tokens"];
    if (st.is_null()) st = json::object();
    MT_CHECK(st.is_object(), "{}: special_tokens is not an object of token texts to ids", path);
    // What the file says, to tell a clash with it from a clash among the options.
    const json from_file = st;
    json from_options = json::object();
    for (const auto& [name, id] : settings.special_tokens) {
      if (from_file.contains(name)) {
        MT_CHECK(from_file[name] == json(id),
                 "--special-token {}={} differs from {}, which gives \"{}\" the id {}; give each special token in one "
                 "place only",
                 name, id, file, name, from_file[name].dump());
        continue;
      }
      for (const auto& [other, other_id] : from_file.items())
        MT_CHECK(other_id != json(id), "--special-token {}={}: {} gives the id {} to \"{}\" already", name, id, file,
                 id, other);
      if (from_options.contains(name))
        MT_CHECK(from_options[name] == json(id), "--special-token gives \"{}\" two ids: {} and {}", name,
                 from_options[name].dump(), id);
      for (const auto& [other, other_id] : from_options.items())
        MT_CHECK(other == name || other_id != json(id), "--special-token gives the id {} to \"{}\" and \"{}\"", id,
                 other, name);
      from_options[name] = id;
      st[name] = id;
    }
  }
  for (const auto& [key, names] :
       {std::pair<const char*, const std::vector<std::string>*>{"document_prefix", &settings.document_prefix},
        {"document_suffix", &settings.document_suffix}}) {
    if (names->empty()) continue;
    const json list = *names;
    const std::string option = std::string("--") + (std::string_view(key) == "document_prefix" ? "document-prefix"
                                                                                              : "document-suffix");
    if (!file.empty() && merged.contains(key) && merged[key] != list)
      MT_THROW("{} {} differs from {} in {}; give it in one place only", option, list.dump(), merged[key].dump(), file);
    merged[key] = list;
  }
  return merged;
}

}  // namespace

const std::string* tiktoken_pattern_preset(std::string_view name) {
  // The patterns as their originals write them (Oniguruma / fancy-regex syntax); the
  // fixtures of tests/data/bpe/ (tests/reference/bpe_reference.py) use the same strings.
  static const std::string llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const std::string o200k =
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
      R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const std::string kimi =
      R"([\p{Han}]+|)"
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)"
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
      R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  if (name == "llama3") return &llama3;
  if (name == "o200k") return &o200k;
  if (name == "kimi") return &kimi;
  return nullptr;
}

std::string tiktoken_pattern_preset_names() { return "llama3, o200k, kimi"; }

std::pair<std::string, int64_t> parse_special_token_option(const std::string& text) {
  const size_t eq = text.rfind('=');
  auto bad = [&]() -> void {
    MT_THROW("--special-token {}: expected NAME=ID, e.g. --special-token '<|endoftext|>=100257' (ids are integers in "
             "[0, {}))",
             text, kTtMaxIds);
  };
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size() || text.size() - eq - 1 > 10) bad();
  const std::string digits = text.substr(eq + 1);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) bad();
  const int64_t id = std::stoll(digits);
  if (id >= kTtMaxIds) bad();
  return {text.substr(0, eq), id};
}

BpeSpec read_tiktoken(const std::string& rank_path, const std::string& rank_text, const std::string& description_path,
                      const TiktokenSettings& settings) {
  BpeSpec spec;
  spec.name = rank_path;
  spec.source = rank_path;
  spec.ignore_merges = true;  // tiktoken: a piece that is a token is that token

  // "base64 rank" per line; blank lines skipped (tiktoken's load_tiktoken_bpe).
  std::unordered_map<std::string, int32_t> rank_of;
  std::vector<std::pair<std::string, int32_t>> ranked;
  int64_t line_no = 0, max_rank = -1;
  for (size_t pos = 0; pos < rank_text.size();) {
    size_t end = rank_text.find('\n', pos);
    if (end == std::string::npos) end = rank_text.size();
    std::string_view line = std::string_view(rank_text).substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    std::optional<std::string> bytes;
    int64_t rank = -1;
    if (space != std::string_view::npos) {
      bytes = tt_base64_decode(line.substr(0, space));
      const std::string_view r = line.substr(space + 1);
      if (!r.empty() && r.size() <= 10 && std::all_of(r.begin(), r.end(), [](char c) { return c >= '0' && c <= '9'; }))
        rank = std::stoll(std::string(r));
    }
    MT_CHECK(bytes.has_value() && !bytes->empty() && rank >= 0 && rank < (int64_t{1} << 31) - 1,
             "{}:{}: expected \"<token in base64> <rank>\" (a tiktoken rank file), found \"{}\"", rank_path, line_no,
             line.substr(0, 80));
    MT_CHECK(rank < kTtMaxIds, "{}:{}: rank {}: moetrain reads ranks (ids) below {}", rank_path, line_no, rank,
             kTtMaxIds);
    MT_CHECK(rank_of.emplace(*bytes, static_cast<int32_t>(rank)).second, "{}:{}: the token {} appears twice",
             rank_path, line_no, line.substr(0, space));
    ranked.emplace_back(std::move(*bytes), static_cast<int32_t>(rank));
    max_rank = std::max(max_rank, rank);
  }
  MT_CHECK(!ranked.empty(), "{}: no tokens; expected a tiktoken rank file (\"<token in base64> <rank>\" per line)",
           rank_path);
  spec.tokens.assign(static_cast<size_t>(max_rank + 1), {});
  spec.has_token.assign(spec.tokens.size(), false);
  spec.mergeable.assign(spec.tokens.size(), false);
  for (auto& [bytes, rank] : ranked) {
    MT_CHECK(!spec.has_token[rank], "{}: the rank {} is given to two tokens", rank_path, rank);
    spec.tokens[rank] = bytes;
    spec.has_token[rank] = true;
    spec.mergeable[rank] = true;
  }
  // tiktoken merges two adjacent parts when their concatenation is a token, at
  // that token's rank: every split of a token into two tokens is a merge.
  for (const auto& [bytes, rank] : ranked)
    for (size_t k = 1; k < bytes.size(); ++k) {
      auto left = rank_of.find(bytes.substr(0, k));
      if (left == rank_of.end()) continue;
      auto right = rank_of.find(bytes.substr(k));
      if (right == rank_of.end()) continue;
      spec.merges.push_back({left->second, right->second, rank, rank});
    }

  std::string description;
  std::error_code exists_ec;
  const bool no_description = !std::filesystem::exists(description_path, exists_ec) && !exists_ec;
  if (no_description && !settings.empty()) {
    // The command line is the whole description.
    std::string pattern_where;
    const json merged = tt_merge_settings(description_path, json(), settings, pattern_where);
    MT_CHECK(merged.contains("pattern"),
             "{}: no description beside it ({}) and no --tiktoken-pattern: give the split pattern (a preset: {}; or "
             "a regex) or write the description (docs/training.md#tokenizers)",
             rank_path, description_path, tiktoken_pattern_preset_names());
    tt_read_description("the command line", merged, spec, pattern_where);
    return spec;
  }
  try {
    description = read_regular_file(description_path, "the tiktoken description", int64_t{16} << 20);
  } catch (const Error& e) {
    MT_THROW("{}: a tiktoken rank file needs its description (split pattern, special tokens) beside it: {} "
             "(docs/training.md#tokenizers)",
             rank_path, e.what());
  }
  json j;
  try {
    j = json::parse(description);
  } catch (const json::exception& e) {
    MT_THROW("{}: not valid JSON ({}); expected the tiktoken description (docs/training.md#tokenizers)",
             description_path, e.what());
  }
  std::string pattern_where;
  const json merged = tt_merge_settings(description_path, j, settings, pattern_where);
  tt_read_description(description_path, merged, spec, pattern_where);
  return spec;
}

BpeSpec read_tiktoken_description(const std::string& path, const json& j, const TiktokenSettings& settings) {
  MT_CHECK(j["tiktoken"].is_string() && !j["tiktoken"].get<std::string>().empty(),
           "{}: tiktoken is {}; expected the path of the rank file (relative to this file)", path, j["tiktoken"].dump());
  std::filesystem::path rank_path = j["tiktoken"].get<std::string>();
  if (rank_path.is_relative()) rank_path = std::filesystem::path(path).parent_path() / rank_path;
  const std::string rank_text = read_regular_file(rank_path.string(), "a tiktoken rank file", int64_t{1} << 30);
  BpeSpec spec = read_tiktoken(rank_path.string(), rank_text, path, settings);
  spec.name = path;
  return spec;
}

}  // namespace moetrain::data
