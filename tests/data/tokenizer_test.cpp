// Tokenizers against OpenAI's encoder.py (tests/reference/gpt2_tokenizer.py,
// run with /usr/bin/python3 and Debian's python3-regex), round trips, UTF-8
// handling, chunked encoding and bad tokenizer files.
#include <catch2/catch.hpp>

#include "core/error.h"
#include "data/tokenizer.h"
#include "data/utf8.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;

namespace {

const Gpt2Tokenizer& gpt2() {
  static const Gpt2Tokenizer tok(kGpt2Dir);
  return tok;
}

// Every hard case of GPT-2's pre-tokenizer we could think of, spelled with
// escapes so that invisible characters are visible here.
std::string torture_text() {
  std::string t;
  t += "\xEF\xBB\xBF" "BOM first. Hello world! <|endoftext|> is ordinary text here.\n";
  // Mixed scripts; Devanagari and Thai have combining marks (Mn/Mc: neither letter nor number).
  t += "English, русский, 中文字符, العربية, עברית, हिन्दी नमस्ते, ภาษาไทย, 한국어, ひらがな カタカナ, Ελληνικά.\n";
  // Emoji: skin tone, ZWJ family, flag, variation selector, keycap.
  t += "Emoji: \xF0\x9F\x91\x8B\xF0\x9F\x8F\xBD "
       "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7"
       " \xF0\x9F\x87\xAB\xF0\x9F\x87\xB7 \xE2\x9D\xA4\xEF\xB8\x8F 1\xEF\xB8\x8F\xE2\x83\xA3!!\n";
  // Combining marks: decomposed e + acute, zalgo, a lone combining mark after a space.
  t += "Caf" "e\xCC\x81 vs Caf\xC3\xA9; Z\xCD\xA7\xCC\x91" "a\xCC\x88\xCD\x96l\xCD\xAEg\xCC\x97o \xCC\x81x\n";
  // CRLF line ends, blank CRLF lines, lone CR, tabs, vertical tab and form feed.
  t += "line one\r\nline two\r\n\r\n\r\nlone\rCR\tand\t\ttabs\x0Bvt\x0C" "ff\n";
  // Runs of spaces: before words, before punctuation, before digits, at line end, alone.
  t += "a  b   c    d     e      .       7\n  leading\n trailing   \n     \n";
  // Contractions in all cases, curly apostrophes, apostrophes alone.
  t += "it's I'll we've they're I'm he'd don't IT'S I'LL WE'VE They'Re 'd 'm 's ' '' ''' it’s rock'n'roll\n";
  // Digits and letters mixed, numbers of many scripts, fractions, superscripts, roman numerals.
  t += "abc123def 1,000,000.50 3.14e-10 0x1F 42nd ١٢٣ ٤٥٦ १२३ ²³ ½ Ⅻ 𝟘𝟙\n";
  // Unicode spaces: NBSP, NNBSP, em space, ideographic space, NEL, line/paragraph separators;
  // U+180E and U+200B are not White_Space; \x1c-\x1f are Python isspace() but not regex \s.
  t += "nb\xC2\xA0sp \xC2\xA0\xC2\xA0word narrow\xE2\x80\xAFnb em\xE2\x80\x83sp ideo\xE3\x80\x80sp"
       " nel\xC2\x85x ls\xE2\x80\xA8ps\xE2\x80\xA9x mvs\xE1\xA0\x8Ey zw\xE2\x80\x8Bsp fs\x1C\x1D\x1E\x1Fus\n";
  // U+180E next to a space and punctuation, where PCRE2's \s (which has it) and regex's differ.
  t += "a \xE1\xA0\x8E!b !\xE1\xA0\x8E? \xE1\xA0\x8E\xE1\xA0\x8E x\xE1\xA0\x8E \n";
  // Letters and digits new in Unicode 15 (Python regex 2022.10 knows them, PCRE2 10.42 does not):
  // CJK Extension H, Kawi, Nag Mundari letters and digits, Kaktovik numerals.
  t += "cjk\xF0\xB1\x8D\x90\xF0\xB1\x8D\x91 kawi\xF0\x91\xBC\x84\xF0\x91\xBC\x85 nag\xF0\x9E\x93\x90\xF0\x9E\x93\xB0"
       " kak\xF0\x9D\x8B\x80\xF0\x9D\x8B\x81 \xF0\x9E\x93\xB0\xF0\x9E\x93\xB1 .\xF0\xB1\x8D\x90. 7\xF0\x9E\x93\xB0!\n";
  // Controls, DEL, a NUL, private use, noncharacters, U+FFFD itself, the last code point.
  t += std::string("ctl\x01\x02\x7F nul") + std::string(1, '\0') +
       "x pua\xEE\x80\x80 nonchar\xEF\xBF\xBE\xEF\xBF\xBF fffd\xEF\xBF\xBD max\xF4\x8F\xBF\xBF\n";
  // Code, long words, long runs.
  t += "def f(x):\n    return x**2  # comment\n\tif (a&&b||!c) { y[i] += 1; }\n";
  t += "pneumonoultramicroscopicsilicovolcanoconiosis " + std::string(300, 'a') + " " + std::string(200, '9') + " " +
       std::string(100, '!') + "\n";
  // Trailing whitespace of every kind at the very end.
  t += "end \t \r\n \xC2\xA0  ";
  return t;
}

}  // namespace

TEST_CASE("gpt2 tokenizer: vocabulary, end-of-text and known ids", "[data][tokenizer]") {
  const Gpt2Tokenizer& tok = gpt2();
  CHECK(tok.vocab_size() == 50257);
  REQUIRE(tok.eot_token().has_value());
  CHECK(*tok.eot_token() == 50256);
  CHECK(tok.name() == "gpt2");
  // Ids as tiktoken's gpt2 encoding gives them.
  CHECK(tok.encode("Hello world") == std::vector<int32_t>{15496, 995});
  CHECK(tok.encode("<|endoftext|>") == std::vector<int32_t>{27, 91, 437, 1659, 5239, 91, 29});  // ordinary text
  CHECK(tok.encode("It's 2024!") == std::vector<int32_t>{1026, 338, 48609, 0});
  CHECK(tok.encode("").empty());
  const std::vector<int32_t> eot = {50256};
  CHECK(tok.decode(eot) == "<|endoftext|>");
}

TEST_CASE("gpt2 tokenizer: equals encoder.py token for token on all of tiny shakespeare", "[data][tokenizer]") {
  const std::string text = read_bytes(kShakespeare);
  const std::vector<int32_t> ids = gpt2().encode(text);
  const std::vector<int32_t> expected = reference_gpt2_ids(kShakespeare);
  REQUIRE(expected.size() == 338025);
  REQUIRE(ids.size() == expected.size());
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] != expected[i]) FAIL("first difference at token " << i << ": " << ids[i] << " vs " << expected[i]);
  CHECK(gpt2().decode(ids) == text);
}

TEST_CASE("gpt2 tokenizer: equals encoder.py on a Unicode and whitespace torture text", "[data][tokenizer]") {
  TempDir dir;
  const std::string text = torture_text();
  write_bytes(dir / "torture.txt", text);
  const std::vector<int32_t> expected = reference_gpt2_ids(dir / "torture.txt");
  const std::vector<int32_t> ids = gpt2().encode(text);
  REQUIRE(expected.size() > 500);
  CHECK(ids == expected);
  // The pieces too: different cuts can give the same ids, so compare the regex's matches.
  const std::vector<std::string_view> pieces = gpt2().split(text);
  CHECK(std::vector<std::string>(pieces.begin(), pieces.end()) == reference_gpt2_pieces(dir / "torture.txt"));
  CHECK(gpt2().decode(ids) == text);

  // Each line alone as well (pieces at the start and end of a text).
  size_t begin = 0;
  int line_no = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    end = end == std::string::npos ? text.size() : end + 1;
    const std::string line = text.substr(begin, end - begin);
    write_bytes(dir / "line.txt", line);
    INFO("line " << line_no << ": " << line);
    CHECK(gpt2().encode(line) == reference_gpt2_ids(dir / "line.txt"));
    begin = end;
    ++line_no;
  }
}

TEST_CASE("gpt2 tokenizer: split() pieces tile the text as GPT-2's regex cuts it", "[data][tokenizer]") {
  using V = std::vector<std::string_view>;
  CHECK(gpt2().split("Hello world") == V{"Hello", " world"});
  CHECK(gpt2().split("it's  x") == V{"it", "'s", " ", " x"});
  CHECK(gpt2().split("a \n\n b") == V{"a", " \n\n", " b"});  // \s+(?!\S) leaves the space before b
  CHECK(gpt2().split("x   ") == V{"x", "   "});
  CHECK(gpt2().split("ab12!?") == V{"ab", "12", "!?"});
  CHECK(gpt2().split("a\xC2\xA0" "b") == V{"a", "\xC2\xA0", "b"});  // NBSP is \s but only ' ' joins a word
  const std::string text = torture_text();
  std::string joined;
  for (std::string_view p : gpt2().split(text)) {
    REQUIRE(!p.empty());
    joined += p;
  }
  CHECK(joined == text);
}

TEST_CASE("gpt2 tokenizer: decode(encode(x)) == x", "[data][tokenizer]") {
  const Gpt2Tokenizer& tok = gpt2();
  for (std::string s : {std::string(""), std::string(" "), std::string("\n\n\n"), std::string("a"),
                        std::string("   leading and trailing   "), torture_text()})
    CHECK(tok.decode(tok.encode(s)) == s);
  // Random bytes made valid by replacement: any UTF-8 text round-trips.
  uint64_t state = 12345;
  for (int trial = 0; trial < 50; ++trial) {
    std::string bytes(1 + trial * 7, '\0');
    for (char& c : bytes) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      c = static_cast<char>(state >> 56);
    }
    const std::string text = replace_invalid_utf8(bytes);
    REQUIRE(find_invalid_utf8(text).offset == -1);
    CHECK(tok.decode(tok.encode(text)) == text);
  }
  // Decoding a prefix may end inside a character; concatenated decodes give the whole.
  const std::vector<int32_t> ids = tok.encode("\xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x91\x8B");
  for (size_t k = 0; k <= ids.size(); ++k) {
    std::span<const int32_t> all(ids);
    CHECK(tok.decode(all.first(k)) + tok.decode(all.subspan(k)) == tok.decode(all));
  }
}

TEST_CASE("gpt2 tokenizer: decode rejects ids outside the vocabulary", "[data][tokenizer][errors]") {
  const std::vector<int32_t> bad = {15496, 50257};
  CHECK_THROWS_WITH(gpt2().decode(bad), Catch::Contains("id 50257") && Catch::Contains("position 1") &&
                                            Catch::Contains("[0, 50257)"));
  const std::vector<int32_t> negative = {-1};
  CHECK_THROWS_AS(gpt2().decode(negative), Error);
}

TEST_CASE("gpt2 tokenizer: ill-formed UTF-8 is an error naming the byte offset", "[data][tokenizer][errors]") {
  CHECK_THROWS_WITH(gpt2().encode("ab\xFF" "cd"),
                    Catch::Contains("invalid UTF-8 at byte offset 2") && Catch::Contains("0xff") &&
                        Catch::Contains("invalid start byte") && Catch::Contains("replace"));
  CHECK_THROWS_WITH(gpt2().encode("surrogate \xED\xA0\x80"), Catch::Contains("byte offset 10"));
  CHECK_THROWS_WITH(gpt2().encode("cut \xE2\x82"), Catch::Contains("byte offset 4") &&
                                                       Catch::Contains("unexpected end of data"));
  CHECK_THROWS_WITH(gpt2().split("\xC0\xAF"), Catch::Contains("byte offset 0"));
}

TEST_CASE("utf8: validation follows Unicode's well-formed byte table", "[data][utf8]") {
  struct Case {
    std::string bytes;
    int64_t offset, length;
  };
  const std::vector<Case> cases = {
      {"plain ascii", -1, 0},
      {"\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x91\x8B\xF4\x8F\xBF\xBF", -1, 0},  // é 中 👋 U+10FFFF
      {"\x80", 0, 1},                      // lone continuation byte
      {"a\xC0\xAF", 1, 1},                 // overlong '/': C0 is never a lead
      {"\xE0\x80\x80", 0, 1},              // overlong 3-byte: E0 needs A0..BF next
      {"\xED\xA0\x80", 0, 1},              // surrogate U+D800: ED needs 80..9F next
      {"\xF0\x80\x80\x80", 0, 1},          // overlong 4-byte
      {"\xF4\x90\x80\x80", 0, 1},          // U+110000
      {"\xF5\x80\x80\x80", 0, 1},          // F5 is never a lead
      {"xy\xE2\x82", 2, 2},                // truncated at the end
      {"\xF0\x9F\x91" "A", 0, 3},          // truncated before an ASCII byte
      {"\xE2\x28\xA1", 0, 1},              // bad second byte
  };
  for (const Case& c : cases) {
    INFO("bytes of length " << c.bytes.size() << " expected offset " << c.offset);
    Utf8Error e = find_invalid_utf8(c.bytes);
    CHECK(e.offset == c.offset);
    CHECK(e.length == c.length);
  }
  CHECK(describe_utf8_error("ab\xED\xA0", find_invalid_utf8("ab\xED\xA0"), 100) ==
        "invalid UTF-8 at byte offset 102 (0xed: invalid continuation byte)");
  // Long ASCII before the error: the 8-byte fast path must not skip it.
  std::string long_text(1000, 'a');
  long_text[997] = '\xFF';
  CHECK(find_invalid_utf8(long_text).offset == 997);
}

TEST_CASE("utf8: replace_invalid_utf8 equals Python's errors=\"replace\" (ids of encoder.py)", "[data][utf8]") {
  const std::string bytes =
      "ok \xFF mid \x80\x80 lone \xC0\xAF overlong \xE0\x80\x80 sur \xED\xA0\x80 big \xF4\x90\x80\x80 f5 \xF5"
      " cut3 \xE2\x82x cut4 \xF0\x9F\x98y bad2 \xE2\x28\xA1 good \xE2\x82\xAC end \xF0\x9F\x98";
  int64_t replaced = 0;
  const std::string repaired = replace_invalid_utf8(bytes, &replaced);
  // Python: one U+FFFD per maximal subpart.
  CHECK(replaced == 1 + 2 + 2 + 3 + 3 + 4 + 1 + 1 + 1 + 2 + 1);
  CHECK(find_invalid_utf8(repaired).offset == -1);
  TempDir dir;
  write_bytes(dir / "bad.txt", bytes);
  CHECK(gpt2().encode(repaired) == reference_gpt2_ids(dir / "bad.txt", "replace"));
  CHECK(replace_invalid_utf8("fine \xE2\x82\xAC") == "fine \xE2\x82\xAC");
}

TEST_CASE("gpt2 tokenizer: chunks cut at find_split_point encode like the whole text", "[data][tokenizer]") {
  const std::string text = read_bytes(kShakespeare) + torture_text();
  const std::vector<int32_t> whole = gpt2().encode(text);
  for (size_t chunk : {size_t{1}, size_t{100}, size_t{4096}, size_t{65536}}) {
    DYNAMIC_SECTION("chunk " << chunk) {
      std::vector<int32_t> ids;
      std::string_view rest = text;
      while (!rest.empty()) {
        size_t cut = find_split_point(rest, chunk);
        if (cut == 0) cut = find_split_point(rest, rest.size());
        if (cut == 0) cut = rest.size();
        const std::vector<int32_t> part = gpt2().encode(rest.substr(0, cut));
        ids.insert(ids.end(), part.begin(), part.end());
        rest.remove_prefix(cut);
      }
      CHECK(ids == whole);
    }
  }
  CHECK(find_split_point("a\nb", 3) == 1);
  CHECK(find_split_point(" \nb", 3) == 0);   // after a space: the space run may join the next piece
  CHECK(find_split_point("\n\nb", 3) == 0);
  CHECK(find_split_point("x.\ny\nz", 3) == 2);  // only before the limit
}

TEST_CASE("gpt2 tokenizer: long runs of one class do not overflow the regex engine", "[data][tokenizer]") {
  for (std::string text : {std::string(1 << 20, ' '), std::string(1 << 20, 'a'), std::string(1 << 20, '7'),
                           std::string(1 << 20, '\n') + "x", "x" + std::string(1 << 20, ' ') + "y",
                           std::string(1 << 19, '!')}) {
    const std::vector<int32_t> ids = gpt2().encode(text);
    CHECK(!ids.empty());
    CHECK(gpt2().decode(ids) == text);
  }
}

TEST_CASE("byte tokenizer: one id per byte, any bytes", "[data][tokenizer]") {
  ByteTokenizer tok;
  CHECK(tok.vocab_size() == 256);
  CHECK(!tok.eot_token().has_value());
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<int32_t> ids = tok.encode(all);
  REQUIRE(ids.size() == 256);
  for (int b = 0; b < 256; ++b) CHECK(ids[b] == b);
  CHECK(tok.decode(ids) == all);
  const std::vector<int32_t> bad = {65, 256};
  CHECK_THROWS_WITH(tok.decode(bad), Catch::Contains("id 256") && Catch::Contains("position 1"));
}

TEST_CASE("make_tokenizer: by name; unknown names are an error", "[data][tokenizer][errors]") {
  CHECK(make_tokenizer("gpt2", kGpt2Dir)->vocab_size() == 50257);
  CHECK(make_tokenizer("byte", "")->vocab_size() == 256);
  CHECK_THROWS_WITH(make_tokenizer("llama", kGpt2Dir), Catch::Contains("\"llama\"") && Catch::Contains("gpt2"));
}

TEST_CASE("gpt2 tokenizer: missing or corrupt files are errors naming the file", "[data][tokenizer][errors]") {
  TempDir dir;
  const std::string encoder = read_bytes(kGpt2Dir + "/encoder.json");
  const std::string merges = read_bytes(kGpt2Dir + "/vocab.bpe");
  const std::string enc_path = dir / "encoder.json", bpe_path = dir / "vocab.bpe";

  CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(enc_path) && Catch::Contains("cannot open"));
  write_bytes(enc_path, encoder);
  CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(bpe_path) && Catch::Contains("cannot open"));
  write_bytes(bpe_path, merges);
  CHECK(Gpt2Tokenizer(dir.path()).encode("Hello world") == std::vector<int32_t>{15496, 995});

  SECTION("truncated JSON") {
    write_bytes(enc_path, encoder.substr(0, encoder.size() / 2));
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(enc_path) && Catch::Contains("not valid JSON"));
  }
  SECTION("JSON of the wrong shape") {
    write_bytes(enc_path, "[1, 2, 3]");
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(enc_path) && Catch::Contains("JSON object"));
    write_bytes(enc_path, R"({"a": 0, "b": "one"})");
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(enc_path) && Catch::Contains("\"b\""));
    write_bytes(enc_path, R"({"a": 0, "b": 5})");
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(enc_path) && Catch::Contains("id 5"));
    write_bytes(enc_path, R"({"a": 0, "b": 1})");  // well-formed but lacks the byte tokens
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(enc_path) && Catch::Contains("no token for byte"));
  }
  SECTION("merge file without header, with a bad line, with an unknown token") {
    write_bytes(bpe_path, merges.substr(merges.find('\n') + 1));
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(bpe_path + ":1") && Catch::Contains("#version"));
    write_bytes(bpe_path, "#version: 0.2\nĠ t\nĠ a\nbroken\n");
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(bpe_path + ":4") && Catch::Contains("\"broken\""));
    write_bytes(bpe_path, "#version: 0.2\nĠ t\nnotatoken x\n");
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(bpe_path + ":3") && Catch::Contains("notatoken"));
    write_bytes(bpe_path, "#version: 0.2\nĠ t\nĠ t\n");
    CHECK_THROWS_WITH(Gpt2Tokenizer(dir.path()), Catch::Contains(bpe_path + ":3") && Catch::Contains("twice"));
  }
}
