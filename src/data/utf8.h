// UTF-8 validation and repair for text that goes into a tokenizer.
//
// Well-formed UTF-8 is Unicode's definition (Table 3-7): no overlong forms, no
// surrogates (U+D800..U+DFFF), nothing above U+10FFFF. Ill-formed input is
// described by its "maximal subparts" (Unicode 15, section 3.9, U+FFFD
// substitution): a byte that cannot start a character is one subpart; a valid
// lead byte followed by the continuation bytes that can still complete it, cut
// short, is one subpart. Python's bytes.decode("utf-8", errors="replace")
// substitutes exactly one U+FFFD per maximal subpart, and so does
// replace_invalid_utf8 (tests/data/tokenizer_test.cpp checks it against Python).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moetrain::data {

struct Utf8Error {
  int64_t offset = -1;       // byte offset of the first ill-formed subpart; -1: the text is valid
  int64_t length = 0;        // bytes in that subpart
  const char* reason = "";   // "invalid start byte", "invalid continuation byte", "unexpected end of data"
};

// The first ill-formed subpart of `text`, or offset -1 when it is valid UTF-8.
Utf8Error find_invalid_utf8(std::string_view text);

// "invalid UTF-8 at byte offset 5 (0xed 0xa0: invalid continuation byte)": for error messages.
// base_offset is added to the offset shown (text is a chunk of a file at that offset).
std::string describe_utf8_error(std::string_view text, const Utf8Error& error, int64_t base_offset = 0);

// `text` with each maximal ill-formed subpart replaced by U+FFFD (EF BF BD), as
// Python's errors="replace". num_replaced, when given, receives the count.
std::string replace_invalid_utf8(std::string_view text, int64_t* num_replaced = nullptr);

// `text` made safe for a terminal: ill-formed UTF-8 replaced as above, and the
// control characters other than newline and tab (C0, DEL; an ESC would start a
// terminal command, NUL and BEL misbehave) written as \xNN. What `moetrain
// generate` prints on a terminal, unless --raw (data/utf8.cpp).
std::string printable_text(std::string_view text);

}  // namespace moetrain::data
