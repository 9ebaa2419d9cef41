// Byte and GPT-2 tokenizers. The GPT-2 one follows OpenAI's encoder.py step by
// step (bytes_to_unicode, the pre-tokenisation regex, bpe() by merge ranks);
// tests/reference/gpt2_tokenizer.py is that file ported, and
// tests/data/tokenizer_test.cpp compares the two token for token.
//
// Internally BPE runs on token ids, not strings: every GPT-2 merge result is a
// token (checked at load), so "merge the pair (a, b)" is "replace ids a, b by
// the id of a+b", and a merge table keyed by the id pair gives rank and result.
#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
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

// encoder.py's bytes_to_unicode(): printable Latin-1 bytes map to themselves,
// the other 68 bytes (controls, space, 0x7f..0xa0, 0xad) to U+0100.. in order,
// so that every token is a string of visible characters.
std::array<uint32_t, 256> bytes_to_unicode() {
  std::array<uint32_t, 256> map{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? b : next++;
  }
  return map;
}

// Decodes one token string of encoder.json / vocab.bpe (UTF-8 of characters of
// the byte alphabet) to its bytes; nullopt if a character is outside it.
std::optional<std::string> token_bytes(std::string_view s, const std::unordered_map<uint32_t, uint8_t>& byte_of) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    auto b0 = static_cast<uint8_t>(s[i]);
    uint32_t cp;
    size_t len;
    if (b0 < 0x80) { cp = b0; len = 1; }
    else if ((b0 & 0xE0) == 0xC0) { cp = b0 & 0x1F; len = 2; }
    else if ((b0 & 0xF0) == 0xE0) { cp = b0 & 0x0F; len = 3; }
    else { cp = b0 & 0x07; len = 4; }
    if (i + len > s.size()) return std::nullopt;
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
    auto it = byte_of.find(cp);
    if (it == byte_of.end()) return std::nullopt;
    out.push_back(static_cast<char>(it->second));
    i += len;
  }
  return out;
}

}  // namespace

// ---- GPT-2: the pre-tokenisation regex ----------------------------------------

// GPT-2's pattern with \s, \p{L}, \p{N} spelled out as Python's `regex` module
// defines them (version 2022.10.31 in Debian 12, Unicode 15.0), measured over
// all code points against PCRE2 10.42 (Unicode 14.0):
//  - \s: regex uses the White_Space property; PCRE2's \s also takes U+180E.
//  - \p{L}, \p{N}: the letters and digits new in Unicode 15 are added by hand
//    (a newer PCRE2 already has them, where the extra ranges change nothing).
#define MT_GPT2_SPACE \
  R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})"
#define MT_GPT2_LETTER                                                                                        \
  R"(\p{L}\x{1123F}-\x{11240}\x{11F02}\x{11F04}-\x{11F10}\x{11F12}-\x{11F33}\x{1342F}\x{13441}-\x{13446})" \
  R"(\x{1B132}\x{1B155}\x{1DF25}-\x{1DF2A}\x{1E030}-\x{1E06D}\x{1E4D0}-\x{1E4EB}\x{2B739}\x{31350}-\x{323AF})"
#define MT_GPT2_NUMBER R"(\p{N}\x{11F50}-\x{11F59}\x{1D2C0}-\x{1D2D3}\x{1E4F0}-\x{1E4F9})"

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d)"
    R"(| ?[)" MT_GPT2_LETTER R"(]+)"
    R"(| ?[)" MT_GPT2_NUMBER R"(]+)"
    R"(| ?[^)" MT_GPT2_SPACE MT_GPT2_LETTER MT_GPT2_NUMBER R"(]+)"
    R"(|[)" MT_GPT2_SPACE R"(]+(?![^)" MT_GPT2_SPACE R"(]))"
    R"(|[)" MT_GPT2_SPACE R"(]+)";

struct Gpt2Tokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() { pcre2_code_free(code); }
};

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  int n = pcre2_get_error_message(code, buf, sizeof(buf));
  if (n < 0) return fmt::format("PCRE2 error {}", code);
  return std::string(reinterpret_cast<char*>(buf), static_cast<size_t>(n));
}

// Calls fn(piece) for each match of the pattern in `text` (valid UTF-8), in
// order. Every character matches some alternative, so the pieces tile the text.
template <class Fn>
void for_each_piece(const pcre2_code* code, bool jit, std::string_view text, Fn&& fn) {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  MT_CHECK(md != nullptr, "gpt2 tokenizer: out of memory for PCRE2 match data");
  struct Free {
    pcre2_match_data* md;
    ~Free() { pcre2_match_data_free(md); }
  } free_md{md};
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t pos = 0;
  while (pos < n) {
    int rc = jit ? pcre2_jit_match(code, subject, n, pos, 0, md, nullptr) : -1;
    // The interpreter serves when there is no JIT, or when a pathological input
    // overflows the JIT stack (it keeps its backtracking frames on the heap).
    if (!jit || rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(code, subject, n, pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0)
      MT_THROW("gpt2 tokenizer: pre-tokenisation failed at byte offset {}: {}", pos, pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    MT_ASSERT(ov[0] == pos && ov[1] > pos, "pieces must tile the text: match [{}, {}) at position {}", ov[0], ov[1],
              pos);
    fn(text.substr(pos, ov[1] - pos));
    pos = ov[1];
  }
}

}  // namespace

// ---- GPT-2: loading ------------------------------------------------------------------

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& dir) {
  const std::string encoder_path = dir + "/encoder.json", merges_path = dir + "/vocab.bpe";
  const std::array<uint32_t, 256> byte_encoder = bytes_to_unicode();
  std::unordered_map<uint32_t, uint8_t> byte_decoder;
  for (int b = 0; b < 256; ++b) byte_decoder[byte_encoder[b]] = static_cast<uint8_t>(b);

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
    std::optional<std::string> bytes = token_bytes(key, byte_decoder);
    MT_CHECK(bytes.has_value() && !bytes->empty(),
             "{}: token \"{}\" (id {}) is not a string of GPT-2 byte-alphabet characters", encoder_path, key, id);
    id_to_bytes_[id] = std::move(*bytes);
    id_of.emplace(key, static_cast<int32_t>(id));
  }
  for (int b = 0; b < 256; ++b) {
    std::string key;
    uint32_t cp = byte_encoder[b];  // < 0x800: one or two UTF-8 bytes
    if (cp < 0x80) key.push_back(static_cast<char>(cp));
    else key += {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    auto it = id_of.find(key);
    MT_CHECK(it != id_of.end(), "{}: no token for byte 0x{:02x} (\"{}\"); a byte-level BPE needs all 256",
             encoder_path, b, key);
    byte_to_id_[b] = it->second;
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
    MT_CHECK(merges_.emplace(key, Merge{rank, ab->second}).second, "{}:{}: merge \"{}\" appears twice", merges_path,
             line_no, line);
    ++rank;
  }
  MT_CHECK(rank > 0, "{}: no merge rules after the header line", merges_path);

  regex_ = std::make_unique<Regex>();
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  regex_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED,
                               PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr);
  MT_ASSERT(regex_->code != nullptr, "GPT-2 pattern does not compile at offset {}: {}", error_offset,
            pcre2_message(error));
  regex_->jit = pcre2_jit_compile(regex_->code, PCRE2_JIT_COMPLETE) == 0;
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
  std::vector<std::string_view> pieces;
  for_each_piece(regex_->code, regex_->jit, text, [&](std::string_view p) { pieces.push_back(p); });
  return pieces;
}

std::vector<int32_t> Gpt2Tokenizer::bpe(std::string_view piece) const {
  std::vector<int32_t> word;
  word.reserve(piece.size());
  for (char c : piece) word.push_back(byte_to_id_[static_cast<uint8_t>(c)]);
  // encoder.py's loop: take the adjacent pair with the lowest merge rank, merge
  // all its occurrences left to right (non-overlapping), repeat until no pair
  // has a rank.
  std::vector<int32_t> next;
  next.reserve(word.size());
  while (word.size() > 1) {
    int32_t best_rank = std::numeric_limits<int32_t>::max(), left = -1, right = -1, merged = -1;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto it = merges_.find((static_cast<uint64_t>(word[i]) << 32) | static_cast<uint32_t>(word[i + 1]));
      if (it != merges_.end() && it->second.rank < best_rank) {
        best_rank = it->second.rank;
        left = word[i];
        right = word[i + 1];
        merged = it->second.merged;
      }
    }
    if (merged < 0) break;
    next.clear();
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == left && word[i + 1] == right) {
        next.push_back(merged);
        i += 2;
      } else {
        next.push_back(word[i]);
        i += 1;
      }
    }
    word.swap(next);
  }
  return word;
}

void Gpt2Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_to_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (auto it = cache_.find(piece); it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<int32_t> ids = bpe(piece);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::string(piece), std::move(ids));
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  check_utf8(text);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 16);  // English runs at ~4 bytes per token
  std::lock_guard lock(cache_mutex_);
  for_each_piece(regex_->code, regex_->jit, text, [&](std::string_view p) { encode_piece(p, ids); });
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
  if (name == "gpt2") return std::make_unique<Gpt2Tokenizer>(tokenizer_dir);
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  MT_THROW("unknown tokenizer \"{}\"; choose gpt2 or byte", name);
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
