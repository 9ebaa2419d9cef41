// Byte and GPT-2 tokenizers. The GPT-2 one follows OpenAI's encoder.py step by
// step (bytes_to_unicode, the pre-tokenisation regex, bpe() by merge ranks);
// tests/reference/gpt2_tokenizer.py is that file ported, and
// tests/data/tokenizer_test.cpp compares the two token for token.
//
// GPT-2 is one instance of the BPE engine (data/bpe.h): this file reads
// encoder.json and vocab.bpe into token bytes and merges (every GPT-2 merge
// result is a token, checked at load); the engine's merge order (lowest rank,
// leftmost first) equals encoder.py's on a merge table learned in order.
#include "data/tokenizer.h"

#include <algorithm>
#include <array>
#include <limits>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe.h"
#include "data/tiktoken.h"
#include "data/tokenizer_json.h"
#include "data/utf8.h"
#include "io/paths.h"

namespace moetrain::data {

// ---- ByteTokenizer ------------------------------------------------------------

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<uint8_t>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    MT_CHECK(ids[i] >= 0 && ids[i] < 256, "byte tokenizer: cannot decode id {} at position {}: ids are in [0, 256)",
             ids[i], i);
    out[i] = static_cast<char>(ids[i]);
  }
  return out;
}

// ---- GPT-2: files -----------------------------------------------------------------

namespace {

// GPT-2's encoder.json has 1 MiB, vocab.bpe 0.5 MiB: 64 MiB is no tokenizer file.
std::string read_file(const std::string& path) {
  return read_regular_file(path, "a tokenizer file", int64_t{64} << 20);
}

}  // namespace

// ---- GPT-2: loading ------------------------------------------------------------------

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& dir) {
  const std::string encoder_path = dir + "/encoder.json", merges_path = dir + "/vocab.bpe";

  // encoder.json: {"token string": id, ...} with ids 0..n-1, each once.
  nlohmann::json encoder;
  try {
    encoder = nlohmann::json::parse(read_file(encoder_path));
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("{}: not valid JSON ({}); expected GPT-2's encoder.json", encoder_path, e.what());
  }
  MT_CHECK(encoder.is_object() && !encoder.empty(),
           "{}: expected a JSON object mapping token strings to ids, found a {}", encoder_path, encoder.type_name());
  const size_t vocab = encoder.size();
  MT_CHECK(vocab <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), "{}: {} tokens is too many",
           encoder_path, vocab);
  id_to_bytes_.resize(vocab);
  std::vector<bool> seen(vocab, false);
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> id_of;  // token string -> id
  id_of.reserve(vocab);
  for (const auto& [key, value] : encoder.items()) {
    MT_CHECK(value.is_number_integer(), "{}: token \"{}\" has id {}; ids are integers", encoder_path, key,
             value.dump());
    const auto id = value.get<int64_t>();
    MT_CHECK(id >= 0 && static_cast<size_t>(id) < vocab,
             "{}: token \"{}\" has id {}, outside [0, {}) for {} tokens; ids must be 0..n-1", encoder_path, key, id,
             vocab, vocab);
    MT_CHECK(!seen[id], "{}: id {} is given to two tokens (one is \"{}\")", encoder_path, id, key);
    seen[id] = true;
    std::optional<std::string> bytes = byte_level_decode(key);
    MT_CHECK(bytes.has_value() && !bytes->empty(),
             "{}: token \"{}\" (id {}) is not a string of GPT-2 byte-alphabet characters", encoder_path, key, id);
    id_to_bytes_[id] = std::move(*bytes);
    id_of.emplace(key, static_cast<int32_t>(id));
  }
  for (int b = 0; b < 256; ++b) {
    const std::string key = byte_level_encode(std::string(1, static_cast<char>(b)));
    MT_CHECK(id_of.find(key) != id_of.end(), "{}: no token for byte 0x{:02x} (\"{}\"); a byte-level BPE needs all 256",
             encoder_path, b, key);
  }
  if (auto it = id_of.find(std::string_view("<|endoftext|>")); it != id_of.end()) eot_ = it->second;

  // vocab.bpe: "#version: 0.2", then one merge "left right" per line, by rank.
  const std::string merges_text = read_file(merges_path);
  MT_CHECK(merges_text.starts_with("#version"),
           "{}:1: expected the header line '#version: 0.2' of GPT-2's vocab.bpe, found \"{}\"", merges_path,
           merges_text.substr(0, std::min<size_t>(40, merges_text.find('\n'))));
  size_t pos = merges_text.find('\n');
  int64_t line_no = 1;
  int32_t rank = 0;
  std::vector<BpeSpec::Merge> merges;
  std::unordered_set<uint64_t> seen_pairs;
  while (pos != std::string::npos && pos + 1 < merges_text.size()) {
    const size_t begin = pos + 1;
    pos = merges_text.find('\n', begin);
    const std::string_view line =
        std::string_view(merges_text).substr(begin, pos == std::string::npos ? std::string::npos : pos - begin);
    ++line_no;
    const size_t space = line.find(' ');
    MT_CHECK(space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                 line.find(' ', space + 1) == std::string_view::npos,
             "{}:{}: expected a merge rule \"left right\" (two tokens and one space), found \"{}\"", merges_path,
             line_no, line);
    const std::string_view left = line.substr(0, space), right = line.substr(space + 1);
    const std::string merged = std::string(left) + std::string(right);
    auto a = id_of.find(left), b = id_of.find(right), ab = id_of.find(merged);
    for (auto [it, what] : {std::pair{a, left}, std::pair{b, right}, std::pair{ab, std::string_view(merged)}})
      MT_CHECK(it != id_of.end(), "{}:{}: merge \"{}\": token \"{}\" is not in {}", merges_path, line_no, line,
               what, encoder_path);
    const uint64_t key = (static_cast<uint64_t>(a->second) << 32) | static_cast<uint32_t>(b->second);
    MT_CHECK(seen_pairs.insert(key).second, "{}:{}: merge \"{}\" appears twice", merges_path, line_no, line);
    merges.push_back({a->second, b->second, ab->second, rank});
    ++rank;
  }
  MT_CHECK(rank > 0, "{}: no merge rules after the header line", merges_path);

  model_ = std::make_unique<BpeModel>(id_to_bytes_, std::vector<bool>(vocab, true), merges, /*ignore_merges=*/false,
                                      encoder_path);
  regex_ = std::make_unique<SplitRegex>(gpt2_split_pattern(), "GPT-2's pattern");
}

Gpt2Tokenizer::~Gpt2Tokenizer() = default;

// ---- GPT-2: encode / decode ------------------------------------------------------------

namespace {
void check_utf8(std::string_view text) {
  Utf8Error e = find_invalid_utf8(text);
  if (e.offset >= 0)
    MT_THROW("gpt2 tokenizer: {}; the GPT-2 tokenizer takes UTF-8 text (replace_invalid_utf8, or prepare "
             "--invalid-utf8 replace, substitutes U+FFFD as Python's errors=\"replace\")",
             describe_utf8_error(text, e));
}
}  // namespace

std::vector<std::string_view> Gpt2Tokenizer::split(std::string_view text) const {
  check_utf8(text);
  std::vector<std::pair<size_t, size_t>> matches;
  regex_->find_matches(text, matches);
  std::vector<std::string_view> pieces;
  size_t end = 0;
  for (auto [b, e] : matches) {
    MT_ASSERT(b == end && e > b, "GPT-2's pieces must tile the text: match [{}, {}) after {}", b, e, end);
    pieces.push_back(text.substr(b, e - b));
    end = e;
  }
  MT_ASSERT(end == text.size(), "GPT-2's pieces must tile the text: they end at {} of {}", end, text.size());
  return pieces;
}

std::vector<int32_t> Gpt2Tokenizer::bpe(std::string_view piece) const {
  std::vector<int32_t> ids;
  if (!piece.empty()) model_->encode_piece(piece, ids);
  return ids;
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 16);  // English runs at ~4 bytes per token
  for (std::string_view piece : split(text)) model_->encode_piece(piece, ids);
  return ids;
}

std::string Gpt2Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size() * 4);
  const int32_t n = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    MT_CHECK(ids[i] >= 0 && ids[i] < n, "gpt2 tokenizer: cannot decode id {} at position {}: ids are in [0, {})",
             ids[i], i, n);
    out += id_to_bytes_[ids[i]];
  }
  return out;
}

// ---- factory and chunking ----------------------------------------------------------------

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name, const std::string& tokenizer_dir) {
  return make_tokenizer(name, tokenizer_dir, TiktokenSettings{});
}

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name, const std::string& tokenizer_dir,
                                          const TiktokenSettings& tiktoken) {
  MT_CHECK(tiktoken.empty() || (name.find('/') != std::string_view::npos || name.find('.') != std::string_view::npos),
           "--tiktoken-pattern, --special-token, --document-prefix and --document-suffix describe a tiktoken rank "
           "file; --tokenizer is {}",
           name);
  if (name == "gpt2") return std::make_unique<Gpt2Tokenizer>(tokenizer_dir);
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  if (name.find('/') != std::string_view::npos || name.find('.') != std::string_view::npos)
    return load_tokenizer_file(std::string(name), tiktoken);
  MT_THROW("unknown tokenizer \"{}\"; choose gpt2, byte, or the path of a tokenizer file (a Hugging Face "
           "tokenizer.json or a tiktoken rank file: docs/training.md#tokenizers)",
           name);
}

std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path) {
  return load_tokenizer_file(path, TiktokenSettings{});
}

std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path, const TiktokenSettings& tiktoken) {
  // Llama 3's tokenizer.json has 9 MB, Qwen2's 7 MB; 1 GiB is no tokenizer file.
  const std::string text = read_regular_file(path, "a tokenizer file", int64_t{1} << 30);
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || text[first] != '{')
    return std::make_unique<BpeTokenizer>(read_tiktoken(path, text, path + ".json", tiktoken));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("{}: not valid JSON ({}); expected a Hugging Face tokenizer.json or a tiktoken description "
             "(docs/training.md#tokenizers)",
             path, e.what());
  }
  if (j.is_object() && j.contains("model")) {
    MT_CHECK(tiktoken.empty(),
             "{}: a Hugging Face tokenizer.json carries its own pattern and special tokens; --tiktoken-pattern, "
             "--special-token, --document-prefix and --document-suffix are for a tiktoken rank file",
             path);
    return std::make_unique<BpeTokenizer>(read_tokenizer_json(path, j));
  }
  if (j.is_object() && j.contains("tiktoken"))
    return std::make_unique<BpeTokenizer>(read_tiktoken_description(path, j, tiktoken));
  MT_THROW("{}: a JSON object with neither \"model\" (a Hugging Face tokenizer.json) nor \"tiktoken\" (a tiktoken "
           "description: docs/training.md#tokenizers)",
           path);
}

size_t find_split_point(std::string_view text, size_t limit) {
  limit = std::min(limit, text.size());
  for (size_t c = limit; c-- > 1;) {
    if (text[c] != '\n') continue;
    const auto prev = static_cast<uint8_t>(text[c - 1]);
    if (prev >= 0x21 && prev <= 0x7E) return c;
  }
  return 0;
}

}  // namespace moetrain::data
