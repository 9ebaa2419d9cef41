// The byte-level BPE engine (conventions in bpe.h). The steps follow HF
// tokenizers 0.2x (tokenizer/added_vocabulary.rs, normalizer/split,
// pre_tokenizers/split.rs, byte_level.rs, models/bpe/word.rs) and tiktoken
// (src/lib.rs); tests/reference/bpe_reference.py builds tokenizers with both and
// tests/data/bpe_test.cpp compares ids token for token.
#include "data/bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <limits>
#include <queue>

#include <fmt/format.h>

#include "core/error.h"
#include "data/utf8.h"

namespace moetrain::data {

// ---- the byte alphabet --------------------------------------------------------------

const std::array<uint32_t, 256>& byte_level_alphabet() {
  // encoder.py's bytes_to_unicode(): printable Latin-1 bytes stand for
  // themselves, the other 68 (controls, space, 0x7f..0xa0, 0xad) for U+0100.. in order.
  static const std::array<uint32_t, 256> map = [] {
    std::array<uint32_t, 256> m{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      m[b] = printable ? b : next++;
    }
    return m;
  }();
  return map;
}

std::optional<std::string> byte_level_decode(std::string_view s) {
  static const std::unordered_map<uint32_t, uint8_t> byte_of = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    for (int b = 0; b < 256; ++b) m[byte_level_alphabet()[b]] = static_cast<uint8_t>(b);
    return m;
  }();
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

std::string byte_level_encode(std::string_view bytes) {
  std::string out;
  for (char c : bytes) {
    uint32_t cp = byte_level_alphabet()[static_cast<uint8_t>(c)];  // < 0x800: one or two UTF-8 bytes
    if (cp < 0x80) out.push_back(static_cast<char>(cp));
    else out += {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
  }
  return out;
}

// ---- regex --------------------------------------------------------------------------

namespace {

std::string bpe_pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  int n = pcre2_get_error_message(code, buf, sizeof(buf));
  if (n < 0) return fmt::format("PCRE2 error {}", code);
  return std::string(reinterpret_cast<char*>(buf), static_cast<size_t>(n));
}

// \s as Oniguruma, fancy-regex and Python's `regex`: the White_Space property
// (PCRE2's \s also takes U+180E).
constexpr const char* kBpeSpace =
    R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// The general categories as tokenizers (Oniguruma) and tiktoken (fancy-regex)
// have them, which is a newer Unicode than PCRE2 10.42's 14.0: per category the
// code points to add to PCRE2's \p{X} and those to take out (measured over all
// code points by tests/reference/unicode_tables.py, which generates the table).
struct BpeCategory {
  const char* name;
  const char* added;    // PCRE2 class text
  const char* removed;  // PCRE2 class text
};
constexpr BpeCategory kBpeCategories[] = {
#include "data/unicode_categories.inc"
};

const BpeCategory* bpe_category(std::string_view name) {
  for (const BpeCategory& c : kBpeCategories)
    if (name == c.name) return &c;
  return nullptr;
}

// The index of the ']' that closes the class opened at p[i] (nested classes,
// escapes and \p{...} skipped).
template <class Refuse>
size_t bpe_class_end(std::string_view p, size_t i, const Refuse& refuse) {
  size_t j = i + 1;
  if (j < p.size() && p[j] == '^') ++j;
  if (j < p.size() && p[j] == ']') ++j;  // a literal ']' first
  while (j < p.size()) {
    if (p[j] == '\\') {
      if (j + 2 < p.size() && (p[j + 1] == 'p' || p[j + 1] == 'P') && p[j + 2] == '{') {
        const size_t close = p.find('}', j);
        if (close == std::string_view::npos) break;
        j = close + 1;
      } else {
        j += 2;
      }
      continue;
    }
    if (p[j] == '[') {
      j = bpe_class_end(p, j, refuse) + 1;
      continue;
    }
    if (p[j] == ']') return j;
    ++j;
  }
  refuse(i, "an unterminated [...] class");
  return p.size();
}

// The operands of && at the top level of a class body.
std::vector<std::string_view> bpe_split_intersection(std::string_view body) {
  std::vector<std::string_view> parts;
  size_t begin = 0, j = 0;
  int depth = 0;
  if (j < body.size() && body[j] == '^') ++j;
  if (j < body.size() && body[j] == ']') ++j;
  while (j < body.size()) {
    if (body[j] == '\\') {
      if (j + 2 < body.size() && (body[j + 1] == 'p' || body[j + 1] == 'P') && body[j + 2] == '{') {
        const size_t close = body.find('}', j);
        j = close == std::string_view::npos ? body.size() : close + 1;
      } else {
        j += 2;
      }
      continue;
    }
    if (body[j] == '[') ++depth;
    else if (body[j] == ']') --depth;
    else if (depth == 0 && body[j] == '&' && j + 1 < body.size() && body[j + 1] == '&') {
      parts.push_back(body.substr(begin, j - begin));
      begin = j + 2;
      j += 2;
      continue;
    }
    ++j;
  }
  parts.push_back(body.substr(begin));
  return parts;
}

}  // namespace

std::string translate_split_pattern(std::string_view p, const std::string& where) {
  std::string out;
  out.reserve(p.size() * 2);
  int class_depth = 0;  // inside [...] (nested classes count too)
  auto refuse = [&](size_t at, const std::string& what) {
    MT_THROW("{}: pattern \"{}\": {} at offset {}; moetrain cannot reproduce this pattern exactly in PCRE2 "
             "(docs/training.md#tokenizers)",
             where, p, what, at);
  };
  // \p{X} (negated: \P{X}) with the code points of the newer Unicode.
  auto category = [&](size_t at, std::string_view name, bool negated) {
    const BpeCategory* c = bpe_category(name);
    if (c == nullptr)
      refuse(at, fmt::format("\\p{{{}}} is not a general category (L, Lu, Ll, Lt, Lm, Lo, M, Mn, Mc, Me, N, Nd, Nl, "
                             "No, P.., S.., Z.., C..) nor one of the scripts Han, Hiragana, Katakana, Hangul, Latin, "
                             "Greek, Cyrillic, Arabic, Hebrew, Thai, Devanagari (the properties measured against "
                             "the originals)",
                             name));
    const bool removes = *c->removed != '\0';
    // Scripts by their Script property, as Oniguruma (PCRE2's plain \p{Han} is Script_Extensions).
    const bool script = name.size() > 2;
    const std::string base = fmt::format("\\p{{{}{}}}{}", script ? "sc:" : "", name, c->added);
    if (class_depth > 0) {
      if (negated) refuse(at, fmt::format("\\P{{{}}} inside a [...] class", name));
      if (removes) refuse(at, fmt::format("\\p{{{}}} inside a [...] class (Unicode took code points out of it)", name));
      out += base;
    } else if (!negated) {
      out += removes ? fmt::format("(?:(?![{}])[{}])", c->removed, base) : "[" + base + "]";
    } else {
      out += removes ? fmt::format("(?:[{}]|[^{}])", c->removed, base) : "[^" + base + "]";
    }
  };
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 'p' || e == 'P') {
        std::string_view name;
        size_t len = 0;
        if (i + 2 < p.size() && p[i + 2] == '{') {
          const size_t close = p.find('}', i + 3);
          if (close == std::string_view::npos) refuse(i, "an unterminated \\p{");
          name = p.substr(i + 3, close - i - 3);
          len = close + 1 - i;
        } else if (i + 2 < p.size()) {
          name = p.substr(i + 2, 1);
          len = 3;
        } else {
          refuse(i, "a \\p without a property");
        }
        category(i, name, e == 'P');
        i += len - 1;
        continue;
      }
      if (e == 'd' || e == 'D') {  // Unicode digits in both engines: \p{Nd}
        category(i, "Nd", e == 'D');
        ++i;
        continue;
      }
      if (e == 's') {
        out += class_depth > 0 ? std::string(kBpeSpace) : fmt::format("[{}]", kBpeSpace);
        ++i;
        continue;
      }
      if (e == 'S') {
        if (class_depth > 0) refuse(i, "\\S inside a [...] class");
        out += fmt::format("[^{}]", kBpeSpace);
        ++i;
        continue;
      }
      if (std::string_view("wWbBhHvVRXN").find(e) != std::string_view::npos)
        refuse(i, fmt::format("\\{} (tokenizers and tiktoken already differ on it)", e));
      out += c;
      out += e;
      ++i;
      continue;
    }
    if (c == '[' && class_depth == 0) {
      // Class intersection [A&&B&&...] (Oniguruma, the regex crate) has no PCRE2
      // spelling, but for one character it is lookaheads: (?:(?=[B])[A]).
      const size_t end = bpe_class_end(p, i, refuse);
      const std::string_view body = p.substr(i + 1, end - i - 1);
      const std::vector<std::string_view> parts = bpe_split_intersection(body);
      if (parts.size() > 1) {
        if (body.front() == '^') refuse(i, "a negated class intersection [^...&&...]");
        std::string first, rest;
        for (size_t k = 0; k < parts.size(); ++k) {
          std::string_view part = parts[k];
          if (part.empty()) refuse(i, "an empty operand of &&");
          const auto at = static_cast<size_t>(part.data() - p.data());
          const bool whole = part.front() == '[' && bpe_class_end(p, at, refuse) == at + part.size() - 1;
          std::string operand;  // built by appends: GCC 12 -Wrestrict false positive on "[" + s (PR 105329)
          if (!whole) operand.push_back('[');
          operand.append(part);
          if (!whole) operand.push_back(']');
          const std::string translated = translate_split_pattern(operand, where);
          if (k == 0) {
            first = translated;
          } else {
            rest.append("(?=").append(translated).append(")");
          }
        }
        out += "(?:" + rest + first + ")";
        i = end;
        continue;
      }
    }
    if (c == '[') {
      if (class_depth > 0 && i + 1 < p.size() && p[i + 1] == ':') refuse(i, "a POSIX class [:...:]");
      ++class_depth;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == ']' && class_depth > 0) {
      --class_depth;
      out += c;
      continue;
    }
    if (c == '&' && class_depth > 0 && i + 1 < p.size() && p[i + 1] == '&') refuse(i, "class intersection (&&)");
    out += c;
  }
  return out;
}

const std::string& gpt2_split_pattern() {
  static const std::string pattern = translate_split_pattern(
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", "GPT-2's pattern");
  return pattern;
}

struct SplitRegex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Impl() { pcre2_code_free(code); }
};

SplitRegex::SplitRegex(const std::string& pattern, const std::string& where) : impl_(std::make_unique<Impl>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                              &error, &offset, nullptr);
  MT_CHECK(impl_->code != nullptr, "{}: the pattern does not compile in PCRE2 at offset {}: {} (pattern \"{}\")",
           where, offset, bpe_pcre2_message(error), pattern);
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD) == 0;
  // \b, \B, \A and lookbehinds count in MAXLOOKBEHIND; ^ and \G outside a class are
  // looked for in the text (conservatively: a false hit only costs chunked reading).
  uint32_t lookbehind = 1;
  pcre2_pattern_info(impl_->code, PCRE2_INFO_MAXLOOKBEHIND, &lookbehind);
  bool anchor = false;
  for (size_t i = 0, depth = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\') {
      if (i + 1 < pattern.size() && pattern[i + 1] == 'G') anchor = true;
      ++i;
    } else if (pattern[i] == '[') {
      ++depth;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') ++i;  // a negated class
    } else if (pattern[i] == ']' && depth > 0) {
      --depth;
    } else if (pattern[i] == '^' && depth == 0) {
      anchor = true;
    }
  }
  looks_behind_ = lookbehind > 0 || anchor;
}

SplitRegex::~SplitRegex() = default;

void SplitRegex::find_matches(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  scan(text, out, false);
}

size_t SplitRegex::find_final_matches(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  return scan(text, out, true);
}

size_t SplitRegex::scan(std::string_view text, std::vector<std::pair<size_t, size_t>>& out, bool partial) const {
  out.clear();
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  MT_CHECK(md != nullptr, "tokenizer: out of memory for PCRE2 match data");
  struct Free {
    pcre2_match_data* md;
    ~Free() { pcre2_match_data_free(md); }
  } free_md{md};
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  const uint32_t hard = partial ? PCRE2_PARTIAL_HARD : 0;
  size_t start = 0;
  std::optional<size_t> last_match_end;
  // A partial scan stops before the end: an attempt there could only read past it.
  while (partial ? start < n : start <= n) {
    int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, n, start, hard, md, nullptr) : -1;
    // The interpreter serves when there is no JIT, or when a pathological input
    // overflows the JIT stack (it keeps its backtracking frames on the heap).
    if (!impl_->jit || rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(impl_->code, subject, n, start, PCRE2_NO_UTF_CHECK | hard, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc == PCRE2_ERROR_PARTIAL) return pcre2_get_ovector_pointer(md)[0];  // what follows decides
    if (rc < 0) MT_THROW("tokenizer: pre-tokenisation failed at byte offset {}: {}", start, bpe_pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (b == e && last_match_end == e) {  // onig's FindMatches: skip, one character on
      if (start >= n) break;
      size_t len = 1;
      const auto lead = static_cast<uint8_t>(text[start]);
      if (lead >= 0xF0) len = 4;
      else if (lead >= 0xE0) len = 3;
      else if (lead >= 0xC0) len = 2;
      start += len;
      continue;
    }
    out.emplace_back(b, e);
    start = e;
    last_match_end = e;
  }
  return n;
}

// ---- NFC ----------------------------------------------------------------------------

std::string nfc_normalize(std::string_view text) {
  if (text.empty()) return {};
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &result,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) MT_THROW("tokenizer: NFC normalization failed: {}", utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
  std::free(result);
  return out;
}

// ---- the model ----------------------------------------------------------------------

BpeModel::BpeModel(const std::vector<std::string>& token_bytes, const std::vector<bool>& mergeable,
                   const std::vector<BpeSpec::Merge>& merges, bool ignore_merges, const std::string& source)
    : ignore_merges_(ignore_merges) {
  std::fill(std::begin(byte_to_id_), std::end(byte_to_id_), -1);
  for (size_t id = 0; id < token_bytes.size(); ++id) {
    if (!mergeable[id]) continue;
    if (token_bytes[id].size() == 1) byte_to_id_[static_cast<uint8_t>(token_bytes[id][0])] = static_cast<int32_t>(id);
    if (ignore_merges) whole_.emplace(token_bytes[id], static_cast<int32_t>(id));
  }
  for (int b = 0; b < 256; ++b)
    MT_CHECK(byte_to_id_[b] >= 0, "{}: no token for the byte 0x{:02x} (\"{}\"); a byte-level BPE needs all 256",
             source, b, byte_level_encode(std::string(1, static_cast<char>(b))));
  merges_.reserve(merges.size());
  for (const BpeSpec::Merge& m : merges) {
    const uint64_t key = (static_cast<uint64_t>(m.left) << 32) | static_cast<uint32_t>(m.right);
    MT_CHECK(merges_.emplace(key, Rule{m.rank, m.merged}).second, "{}: the merge of tokens {} and {} appears twice",
             source, m.left, m.right);
  }
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_to_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (ignore_merges_)
    if (auto it = whole_.find(piece); it != whole_.end()) {
      out.push_back(it->second);
      return;
    }
  // HF's Word::merge_all: a queue of (rank, position) with the lowest first;
  // an entry is stale when its left symbol is gone or the pair there no longer
  // merges into the same token.
  struct Symbol {
    int32_t id, prev, next;
    bool alive;
  };
  struct Entry {
    int32_t rank, pos, merged;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const auto n = static_cast<int32_t>(piece.size());
  std::vector<Symbol> sym(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) sym[i] = {byte_to_id_[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  auto rule = [&](int32_t left, int32_t right) -> const Rule* {
    auto it = merges_.find((static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right));
    return it == merges_.end() ? nullptr : &it->second;
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  for (int32_t i = 0; i + 1 < n; ++i)
    if (const Rule* r = rule(sym[i].id, sym[i + 1].id)) queue.push({r->rank, i, r->merged});
  while (!queue.empty()) {
    const Entry top = queue.top();
    queue.pop();
    Symbol& s = sym[top.pos];
    if (!s.alive || s.next < 0) continue;
    const int32_t right = s.next;
    const Rule* now = rule(s.id, sym[right].id);
    if (now == nullptr || now->merged != top.merged) continue;
    s.id = top.merged;
    sym[right].alive = false;
    s.next = sym[right].next;
    if (s.next >= 0) sym[s.next].prev = top.pos;
    if (s.prev >= 0)
      if (const Rule* r = rule(sym[s.prev].id, s.id)) queue.push({r->rank, s.prev, r->merged});
    if (s.next >= 0)
      if (const Rule* r = rule(s.id, sym[s.next].id)) queue.push({r->rank, top.pos, r->merged});
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

// ---- the tokenizer ------------------------------------------------------------------

BpeTokenizer::BpeTokenizer(BpeSpec spec)
    : spec_(std::move(spec)),
      model_(spec_.tokens, spec_.mergeable, spec_.merges, spec_.ignore_merges, spec_.source) {
  for (const BpeSpec::Step& step : spec_.steps) {
    if (step.kind == BpeSpec::Step::Kind::split) regexes_.push_back(std::make_unique<SplitRegex>(step.pattern, step.where));
    else regexes_.push_back(nullptr);
    if (step.kind == BpeSpec::Step::Kind::byte_level && step.use_regex && !gpt2_regex_)
      gpt2_regex_ = std::make_unique<SplitRegex>(gpt2_split_pattern(), "GPT-2's pattern");
  }
  for (size_t k = 0; k < spec_.added.size(); ++k) {
    const BpeSpec::Added& a = spec_.added[k];
    MT_CHECK(!a.content.empty(), "{}: added token {} is empty", spec_.source, a.id);
    added_by_byte_[a.normalized ? 1 : 0][static_cast<uint8_t>(a.content[0])].push_back(static_cast<int32_t>(k));
  }
  for (const BpeSpec::Added& a : spec_.added)
    longest_added_[a.normalized ? 1 : 0] = std::max(longest_added_[a.normalized ? 1 : 0], a.content.size());
  if (!spec_.steps.empty()) {
    const BpeSpec::Step& first = spec_.steps[0];
    if (first.kind == BpeSpec::Step::Kind::split)
      chunkable_ = (first.behavior == SplitBehavior::isolated || first.behavior == SplitBehavior::removed) &&
                   !regexes_[0]->looks_behind();
    else
      chunkable_ = first.use_regex && !first.add_prefix_space && !gpt2_regex_->looks_behind();
  }
  for (auto& table : added_by_byte_)
    for (auto& list : table)
      std::stable_sort(list.begin(), list.end(), [&](int32_t x, int32_t y) {
        return spec_.added[x].content.size() > spec_.added[y].content.size();
      });
  spec_.merges.clear();
  spec_.merges.shrink_to_fit();
}

BpeTokenizer::~BpeTokenizer() = default;

void BpeTokenizer::split_added(std::string_view text, bool normalized,
                               std::vector<std::pair<std::string_view, int32_t>>& out) const {
  const auto& table = added_by_byte_[normalized ? 1 : 0];
  size_t begin = 0;
  for (size_t i = 0; i < text.size();) {
    int32_t found = -1;
    for (int32_t k : table[static_cast<uint8_t>(text[i])]) {
      const std::string& c = spec_.added[k].content;
      if (text.compare(i, c.size(), c) == 0) {
        found = k;  // longest first
        break;
      }
    }
    if (found < 0) {
      ++i;
      continue;
    }
    if (i > begin) out.emplace_back(text.substr(begin, i - begin), -1);
    out.emplace_back(text.substr(i, spec_.added[found].content.size()), spec_.added[found].id);
    i += spec_.added[found].content.size();
    begin = i;
  }
  if (begin < text.size()) out.emplace_back(text.substr(begin), -1);
}

namespace {

// HF's NormalizedString::split: the pieces of `text` given the pattern's
// matches, by behaviour (empty pieces dropped).
void bpe_apply_behavior(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches,
                        SplitBehavior behavior, bool invert, std::vector<std::string_view>& out) {
  // (offsets, is_match) covering the text, gaps included.
  struct Span {
    size_t b, e;
    bool match;
  };
  std::vector<Span> spans;
  size_t prev = 0;
  for (auto [b, e] : matches) {
    if (prev != b) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }
  if (prev != text.size()) spans.push_back({prev, text.size(), invert});
  std::vector<Span> kept;  // match = "remove" here
  switch (behavior) {
    case SplitBehavior::isolated:
      for (const Span& s : spans) kept.push_back({s.b, s.e, false});
      break;
    case SplitBehavior::removed:
      kept = spans;
      break;
    case SplitBehavior::contiguous: {
      bool previous = false;
      for (const Span& s : spans) {
        if (s.match == previous && !kept.empty()) kept.back().e = s.e;
        else kept.push_back({s.b, s.e, false});
        previous = s.match;
      }
      break;
    }
    case SplitBehavior::merged_with_previous: {
      bool previous = false;
      for (const Span& s : spans) {
        if (s.match && !previous && !kept.empty()) kept.back().e = s.e;
        else kept.push_back({s.b, s.e, false});
        previous = s.match;
      }
      break;
    }
    case SplitBehavior::merged_with_next: {
      bool previous = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous && !kept.empty()) kept.back().b = it->b;
        else kept.push_back({it->b, it->e, false});
        previous = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
  }
  for (const Span& s : kept)
    if (!s.match && s.e > s.b) out.push_back(text.substr(s.b, s.e - s.b));
}

}  // namespace

void BpeTokenizer::split_pieces(std::string_view text, std::deque<std::string>& arena,
                                std::vector<std::string_view>& pieces) const {
  std::vector<std::string_view> next;
  std::vector<std::pair<size_t, size_t>> matches;
  pieces.clear();
  if (!text.empty()) pieces.push_back(text);
  for (size_t k = 0; k < spec_.steps.size(); ++k) {
    const BpeSpec::Step& step = spec_.steps[k];
    next.clear();
    for (std::string_view piece : pieces) {
      if (step.kind == BpeSpec::Step::Kind::byte_level) {
        if (step.add_prefix_space && piece.front() != ' ') {
          std::string spaced;  // not " " + piece: GCC 12 -Wrestrict false positive (PR 105329)
          spaced.reserve(piece.size() + 1);
          spaced.push_back(' ');
          spaced.append(piece);
          arena.push_back(std::move(spaced));
          piece = arena.back();
        }
        if (!step.use_regex) {
          next.push_back(piece);
          continue;
        }
        gpt2_regex_->find_matches(piece, matches);
        bpe_apply_behavior(piece, matches, SplitBehavior::isolated, false, next);
      } else {
        regexes_[k]->find_matches(piece, matches);
        bpe_apply_behavior(piece, matches, step.behavior, step.invert, next);
      }
    }
    pieces.swap(next);
  }
}

std::vector<std::string> BpeTokenizer::pre_tokenize(std::string_view text) const {
  const std::string normalized = spec_.nfc ? nfc_normalize(text) : std::string(text);
  std::deque<std::string> arena;
  std::vector<std::string_view> pieces;
  split_pieces(normalized, arena, pieces);
  return {pieces.begin(), pieces.end()};
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  if (Utf8Error e = find_invalid_utf8(text); e.offset >= 0)
    MT_THROW("{} tokenizer: {}; it takes UTF-8 text (replace_invalid_utf8, or prepare --invalid-utf8 replace, "
             "substitutes U+FFFD as Python's errors=\"replace\")",
             spec_.name, describe_utf8_error(text, e));
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 16);
  std::vector<std::pair<std::string_view, int32_t>> raw, norm;
  std::deque<std::string> arena;
  std::vector<std::string_view> pieces;
  split_added(text, false, raw);
  std::string normalized;
  for (auto [segment, id] : raw) {
    if (id >= 0) {
      ids.push_back(id);
      continue;
    }
    std::string_view s = segment;
    if (spec_.nfc) {
      normalized = nfc_normalize(segment);
      s = normalized;
    }
    norm.clear();
    split_added(s, true, norm);
    for (auto [sub, sub_id] : norm) {
      if (sub_id >= 0) ids.push_back(sub_id);
      else {
        arena.clear();
        split_pieces(sub, arena, pieces);
        for (std::string_view piece : pieces) model_.encode_piece(piece, ids);
      }
    }
  }
  return ids;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size() * 4);
  const int32_t n = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    MT_CHECK(ids[i] >= 0 && ids[i] < n, "{} tokenizer: cannot decode id {} at position {}: ids are in [0, {})",
             spec_.name, ids[i], i, n);
    out += spec_.tokens[ids[i]];  // an id no token has (a reserved one) is empty, as HF's decode skips it
  }
  return out;
}

// Step `step` on `text` (one piece of the step before; more of it may follow when
// `open`) cut at q: the pieces of text[0, q) and of the rest must be the whole's.
// At a boundary of the step's matches (final ones: no later byte changes them)
// the whole's search restarts there as the rest's does (the pattern looks at
// nothing before its start offset), and the part before is searched alone and
// compared. Inside a gap between matches, the same holds for the gap's start;
// the gap is one piece (Isolated, or Removed without invert), which the next
// steps must cut at q in turn, or dropped (Removed with invert). Inside a match
// the rest's search would start where the whole's did not: refused.
bool BpeTokenizer::cut_keeps_pieces(std::string_view text, size_t q, bool open, size_t step) const {
  for (; step < spec_.steps.size(); ++step) {
    const BpeSpec::Step& st = spec_.steps[step];
    if (st.kind == BpeSpec::Step::Kind::byte_level && !st.use_regex) {
      if (st.add_prefix_space) return false;  // the rest would get a space of its own
      continue;
    }
    if (st.kind == BpeSpec::Step::Kind::byte_level && st.add_prefix_space) return false;
    const SplitRegex& regex = st.kind == BpeSpec::Step::Kind::split ? *regexes_[step] : *gpt2_regex_;
    const SplitBehavior behavior = st.kind == BpeSpec::Step::Kind::split ? st.behavior : SplitBehavior::isolated;
    const bool invert = st.kind == BpeSpec::Step::Kind::split && st.invert;
    if (regex.looks_behind() || (behavior != SplitBehavior::isolated && behavior != SplitBehavior::removed))
      return false;
    std::vector<std::pair<size_t, size_t>> matches, alone;
    const size_t settled = open ? regex.find_final_matches(text, matches) : (regex.find_matches(text, matches), text.size());
    // The span holding q: after `before` matches; a boundary, or inside the gap [gap_b, gap_e).
    size_t before = 0, gap_b = 0;
    bool boundary = q == 0, in_match = false;
    std::optional<size_t> gap_e;
    for (const auto& [b, e] : matches) {
      if (e <= q) {
        ++before;
        gap_b = e;
        if (e == q) boundary = true;
        continue;
      }
      if (b == q) boundary = true;
      else if (b < q) in_match = true;
      else gap_e = b;
      break;
    }
    if (in_match) return false;
    if (!boundary && !gap_e && q >= settled) return false;  // a match may still start before q
    regex.find_matches(text.substr(0, q), alone);
    if (alone.size() != before || !std::equal(alone.begin(), alone.end(), matches.begin())) return false;
    if (boundary) return true;
    const bool gap_kept = behavior == SplitBehavior::isolated || !invert;
    if (!gap_kept) return true;  // removed on both sides of the cut
    open = open && !gap_e;
    text = text.substr(gap_b, gap_e ? *gap_e - gap_b : std::string_view::npos);
    q -= gap_b;
  }
  return false;  // inside a piece that BPE would see in two
}

// A cut of a document's text such that its parts encode as the whole (tokenizer.h
// find_cut). The pipeline is followed on `text` up to a window end that more text
// cannot change, and a cut is taken where every stage agrees:
//   - the window ends before an ASCII byte (so NFC and U+FFFD repair of the window
//     are a prefix of the whole's: an ASCII character is a starter that composes
//     with nothing before it, and no ill-formed sequence contains one), and at
//     least the longest added token before the end of `text`;
//   - the cut is right after a '\n' of the last segment between added tokens (raw
//     and then normalized: no added token spans it) and before an ASCII byte other
//     than whitespace; NFC neither makes nor takes a '\n', so the k-th of the raw
//     segment is the k-th of the normalized one;
//   - in the normalized sub-segment, the cut is a boundary of the first step's
//     matches that are final (find_final_matches: no later byte changes them), so
//     the whole's search restarts there as the rest's does (the pattern does not
//     look behind), and the matches of the part before the cut, searched alone,
//     are exactly the whole's there (checked). Later steps work inside pieces.
size_t BpeTokenizer::find_cut(std::string_view text, bool repair) const {
  if (!chunkable_) return 0;
  const size_t longest_raw = longest_added_[0], longest_norm = longest_added_[1];
  if (text.size() <= longest_raw + 1) return 0;
  size_t limit = text.size() - std::max<size_t>(longest_raw, 1);  // text[limit] exists
  while (limit > 0 && static_cast<uint8_t>(text[limit]) >= 0x80) --limit;  // text[limit]: ASCII
  std::string_view raw = text.substr(0, limit);
  if (!repair) {
    // Encoding fails on ill-formed UTF-8 (the part holding it says where): look before it only.
    if (const Utf8Error e = find_invalid_utf8(raw); e.offset >= 0) {
      limit = static_cast<size_t>(e.offset);
      while (limit > 0 && static_cast<uint8_t>(text[limit]) >= 0x80) --limit;
      raw = text.substr(0, limit);
    }
  }
  if (raw.empty()) return 0;
  std::string repaired;
  if (repair) repaired = replace_invalid_utf8(raw);
  const std::string_view work = repair ? std::string_view(repaired) : raw;  // the same '\n's as raw

  // The last raw segment: after the last added token of the window.
  std::vector<std::pair<std::string_view, int32_t>> parts;
  split_added(work, false, parts);
  size_t seg_begin = 0;
  for (const auto& [part, id] : parts)
    if (id >= 0) seg_begin = static_cast<size_t>(part.data() + part.size() - work.data());
  if (work.size() - seg_begin <= longest_raw) return 0;
  const std::string_view seg = work.substr(seg_begin);
  std::string normalized_storage;
  if (spec_.nfc) normalized_storage = nfc_normalize(seg);
  const std::string_view norm = spec_.nfc ? std::string_view(normalized_storage) : seg;
  // The last normalized sub-segment.
  parts.clear();
  split_added(norm, true, parts);
  size_t sub_begin = 0;
  for (const auto& [part, id] : parts)
    if (id >= 0) sub_begin = static_cast<size_t>(part.data() + part.size() - norm.data());
  if (norm.size() - sub_begin <= longest_norm) return 0;
  const std::string_view sub = norm.substr(sub_begin);

  // '\n' positions: the k-th of seg is the k-th of norm; in raw, count those before seg.
  std::vector<size_t> nl_raw, nl_norm;
  for (size_t i = 0; i < raw.size(); ++i)
    if (raw[i] == '\n') nl_raw.push_back(i);
  const auto before_seg = static_cast<size_t>(std::count(work.begin(), work.begin() + seg_begin, '\n'));
  for (size_t i = 0; i < norm.size(); ++i)
    if (norm[i] == '\n') nl_norm.push_back(i);
  if (nl_raw.size() != before_seg + nl_norm.size()) return 0;  // cannot happen; never guess

  int tries = 0;
  for (size_t k = nl_norm.size(); k-- > 0 && tries < 8;) {
    const size_t j = nl_norm[k] + 1;  // in norm
    if (j < sub_begin) break;
    if (j + longest_norm > norm.size()) continue;
    const size_t p = nl_raw[before_seg + k] + 1;  // in text
    if (p + longest_raw >= limit) continue;  // every added-token decision before p is final
    const auto next = static_cast<uint8_t>(text[p]);
    if (next >= 0x80 || next == ' ' || next == '\t' || next == '\n' || next == '\r' || next == '\v' || next == '\f')
      continue;
    ++tries;
    if (j == sub_begin || cut_keeps_pieces(sub, j - sub_begin, /*open=*/true, 0)) return p;
  }
  return 0;
}

}  // namespace moetrain::data
