// UTF-8 validation by Unicode's Table 3-7 (well-formed byte sequences):
//
//   U+0000..U+007F     00..7F
//   U+0080..U+07FF     C2..DF  80..BF
//   U+0800..U+0FFF     E0      A0..BF  80..BF
//   U+1000..U+CFFF     E1..EC  80..BF  80..BF
//   U+D000..U+D7FF     ED      80..9F  80..BF
//   U+E000..U+FFFF     EE..EF  80..BF  80..BF
//   U+10000..U+3FFFF   F0      90..BF  80..BF  80..BF
//   U+40000..U+FFFFF   F1..F3  80..BF  80..BF  80..BF
//   U+100000..U+10FFFF F4      80..8F  80..BF  80..BF
#include "data/utf8.h"

#include <fmt/format.h>

namespace moetrain::data {

namespace {

// The result of decoding one character at text[i]: its length in bytes when
// well-formed (ok), else the length of the maximal ill-formed subpart.
struct Step {
  bool ok;
  int64_t length;
  const char* reason;
};

Step step(std::string_view text, int64_t i) {
  const auto n = static_cast<int64_t>(text.size());
  const auto b0 = static_cast<uint8_t>(text[i]);
  if (b0 < 0x80) return {true, 1, ""};
  int need;                      // continuation bytes after the lead
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;  // no overlongs
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {false, 1, "invalid start byte"};  // 80..C1, F5..FF
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= n) return {false, k, "unexpected end of data"};
    const auto b = static_cast<uint8_t>(text[i + k]);
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return {false, k, "invalid continuation byte"};
  }
  return {true, need + 1, ""};
}

}  // namespace

Utf8Error find_invalid_utf8(std::string_view text) {
  const auto n = static_cast<int64_t>(text.size());
  for (int64_t i = 0; i < n;) {
    // ASCII fast path: 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, text.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    Step s = step(text, i);
    if (!s.ok) return {i, s.length, s.reason};
    i += s.length;
  }
  return {};
}

std::string describe_utf8_error(std::string_view text, const Utf8Error& error, int64_t base_offset) {
  std::string bytes;
  for (int64_t k = 0; k < error.length; ++k)
    bytes += fmt::format("{}0x{:02x}", k ? " " : "", static_cast<uint8_t>(text[error.offset + k]));
  return fmt::format("invalid UTF-8 at byte offset {} ({}: {})", base_offset + error.offset, bytes, error.reason);
}

std::string replace_invalid_utf8(std::string_view text, int64_t* num_replaced) {
  std::string out;
  out.reserve(text.size());
  int64_t replaced = 0;
  const auto n = static_cast<int64_t>(text.size());
  for (int64_t i = 0; i < n;) {
    Step s = step(text, i);
    if (s.ok) {
      out.append(text.data() + i, static_cast<size_t>(s.length));
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++replaced;
    }
    i += s.length;
  }
  if (num_replaced) *num_replaced = replaced;
  return out;
}

std::string printable_text(std::string_view text) {
  const std::string valid = replace_invalid_utf8(text);
  std::string out;
  out.reserve(valid.size());
  for (const char ch : valid) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += ch;
  }
  return out;
}

}  // namespace moetrain::data
