// A .txt file read in parts with a tokenizer file (BpeTokenizer::find_cut,
// data/bpe.h; prepare's ChunkReader, data/prepare.h): the parts encode as the
// whole, for every tokenizer of the fixtures (tests/data/bpe/: Llama 3 with NFC
// and added tokens, DeepSeek's Sequence of Splits, the tiktoken patterns), and
// prepare's shards are the bytes of the whole-file read for any --chunk-bytes and
// thread count, also with ill-formed UTF-8 repaired.
#include <catch2/catch.hpp>

#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe.h"
#include "data/prepare.h"
#include "data/tiktoken.h"
#include "data/tokenizer.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;

namespace {

const std::string kChunkFixtures = kSourceDir + "/tests/data/bpe";
const std::vector<std::string> kChunkTokenizers = {"llama3_nfc.tokenizer.json", "deepseek_style.tokenizer.json",
                                                   "llama3.tiktoken", "o200k_style.tiktoken", "kimi_style.tiktoken"};

// The stress texts of the fixtures, each on its own lines, between lines of the corpus:
// added tokens, combining marks, CR LF, whitespace runs and Unicode next to line breaks.
std::string chunk_stress_text() {
  const nlohmann::json texts = nlohmann::json::parse(read_bytes(kChunkFixtures + "/texts.json"));
  const std::string corpus = read_bytes(kShakespeare);
  std::string out;
  size_t at = 0;
  for (const auto& t : texts) {
    out += corpus.substr(at, 700);
    at += 700;
    out += "\n" + t.get<std::string>() + "\n";
    out += "x\xCC\x81\n<tool>\n</tool>y\n\xCC\x81z\n<|begin_of_text|>\nA\r\nB\n \nC";  // marks and tokens at cuts
  }
  return out;
}

PrepareOptions chunk_options(const std::string& input, const std::string& out, const std::string& tok) {
  PrepareOptions o;
  o.inputs = {input};
  o.out_dir = out;
  o.tokenizer = tok;
  o.val_tokens = 0;
  o.shard_tokens = 40000;
  o.progress.mode = ProgressOptions::Mode::off;
  return o;
}

std::string chunk_shard_bytes(const PrepareSummary& s) {
  std::string bytes;
  for (const PreparedShard& shard : s.shards) bytes += read_bytes(shard.path);
  return bytes;
}

}  // namespace

TEST_CASE("bpe chunks: a cut's two parts encode as the whole", "[data][tokenizer][bpe]") {
  const std::string text = chunk_stress_text();
  for (const std::string& name : kChunkTokenizers) {
    INFO(name);
    const auto tok = load_tokenizer_file(kChunkFixtures + "/" + name);
    REQUIRE(tok->encodes_in_chunks());
    const std::vector<int32_t> whole = tok->encode(text);
    // Many prefixes: the cut (if any) splits the whole text into parts that encode as it.
    int cuts = 0;
    for (size_t len = 40; len < text.size(); len += 97) {
      const size_t p = tok->find_cut(std::string_view(text).substr(0, len), false);
      if (p == 0) continue;
      REQUIRE(p < len);
      ++cuts;
      std::vector<int32_t> parts = tok->encode(std::string_view(text).substr(0, p));
      const std::vector<int32_t> rest = tok->encode(std::string_view(text).substr(p));
      parts.insert(parts.end(), rest.begin(), rest.end());
      INFO("cut at " << p << " of a prefix of " << len << ": ..." << text.substr(p > 30 ? p - 30 : 0, 60));
      REQUIRE(parts == whole);
    }
    CHECK(cuts > 200);  // cuts are found, not only refused
  }
}

TEST_CASE("bpe chunks: what cannot be cut is read whole", "[data][tokenizer][bpe]") {
  // GPT-2 style tokenizer.json: ByteLevel adds a prefix space to each segment; a cut would add one more.
  CHECK_FALSE(load_tokenizer_file(kChunkFixtures + "/gpt2_style.tokenizer.json")->encodes_in_chunks());
  // The behaviours fixture's first Split merges matches with the previous piece.
  CHECK_FALSE(load_tokenizer_file(kChunkFixtures + "/behaviors.tokenizer.json")->encodes_in_chunks());
  // No line break: no cut.
  const auto tok = load_tokenizer_file(kChunkFixtures + "/llama3.tiktoken");
  CHECK(tok->find_cut(std::string(5000, 'a') + " " + std::string(5000, 'b'), false) == 0);
  // The last '\n' before a non-space whose line the pattern has matched for good, at least the
  // longest added token (<|begin_of_text|>, 17 bytes) before the end.
  const std::string xs(40, 'x');
  CHECK(tok->find_cut("first line\nsecond line\n" + xs, false) == 23);
  CHECK(tok->find_cut("first line\nsecond line\n" + std::string(5, 'x'), false) == 0);  // 17 bytes: too near the end
  CHECK(tok->find_cut("first line\n\n\nsecond line\n  " + xs, false) == 13);  // not inside "\n\n\n", nor before spaces
  // Right after an added token, in the text that follows it.
  CHECK(tok->find_cut("ab\nc<|end_of_text|>\nde" + xs, false) == 20);
  // A match that looks ahead to the end of what has been read is not final: here "\n" alone
  // is a match only when no capitals and a line break follow; in 50 capitals read so far
  // none does, but the file goes on "CCC...C\nd" and then "\nCCC...C" is the match.
  {
    TempDir tmp;
    write_bytes(tmp / "r.tiktoken", read_bytes(kChunkFixtures + "/llama3.tiktoken"));
    TiktokenSettings look;
    look.pattern = "\\n(?![A-Z]+\\n)|\\n[A-Z]+|[^\\n]+";
    const auto ahead = make_tokenizer(tmp / "r.tiktoken", "", look);
    const std::string whole = "ab\n" + std::string(50, 'C') + "\nd\ne";
    CHECK(ahead->find_cut(std::string_view(whole).substr(0, 40), false) == 0);
    const size_t p = ahead->find_cut(whole, false);  // after "C...C\n": the "\nd" match starts there
    CHECK(p == 54);
    std::vector<int32_t> parts = ahead->encode(whole.substr(0, p)), rest = ahead->encode(whole.substr(p));
    parts.insert(parts.end(), rest.begin(), rest.end());
    CHECK(parts == ahead->encode(whole));
  }
  // The part before a cut is matched alone too: "[a-z]+\n" is one match only when more text
  // follows, so "ef\n" at the end of a part would be two pieces where the whole has one.
  {
    TempDir tmp;
    write_bytes(tmp / "r.tiktoken", read_bytes(kChunkFixtures + "/llama3.tiktoken"));
    TiktokenSettings end_sensitive;
    end_sensitive.pattern = "[a-z]+\\n(?!$)|[a-z]+|\\n";
    const auto tok2 = make_tokenizer(tmp / "r.tiktoken", "", end_sensitive);
    const std::string whole = "ab\ncd\nef\ngh";
    const size_t p = tok2->find_cut(whole, false);
    CHECK(p == 0);
    std::vector<int32_t> parts = tok2->encode(whole.substr(0, p)), rest = tok2->encode(whole.substr(p));
    parts.insert(parts.end(), rest.begin(), rest.end());
    CHECK(parts == tok2->encode(whole));
  }
  // Ill-formed UTF-8 without repair: no cut after it (the part with it fails to encode, naming it).
  const std::string bad = std::string(30, 'a') + "\n" + std::string(30, 'b') + "\nc\xFF\nd\ne\n" + xs;
  CHECK(tok->find_cut(bad, false) == 31);
  CHECK(tok->find_cut(bad, true) > 62);
}

TEST_CASE("bpe chunks: prepare's shards are the whole-file read's for any --chunk-bytes and threads",
          "[data][prepare][bpe]") {
  TempDir dir;
  write_bytes(dir / "stress.txt", chunk_stress_text());
  std::string bad = read_bytes(kShakespeare).substr(0, 60000);
  for (size_t at : {size_t{777}, size_t{5001}, size_t{5002}, size_t{20000}, size_t{40001}})
    bad.insert(at, at % 2 ? "\xE4\xB8" : "\xFF\n\xC0\xAF");  // truncated sequences, a lone byte, overlong
  write_bytes(dir / "bad.txt", bad);
  std::mt19937 rng(39);
  for (const std::string& name : {kChunkTokenizers[0], kChunkTokenizers[1], kChunkTokenizers[4]}) {
    for (const std::string input : {"stress.txt", "shakespeare", "bad.txt"}) {
      const std::string path = input == "shakespeare" ? kShakespeare : dir / input;
      std::string whole;
      for (size_t chunk : {size_t{1} << 30, size_t{1}, size_t{61}, size_t{4096}, size_t{65536}}) {
        for (int threads : {1, 2}) {
          if (chunk == size_t{1} << 30 && threads == 2) continue;
          INFO(name << ", " << input << ", --chunk-bytes " << chunk << ", threads " << threads);
          const std::string out = dir / ("o" + std::to_string(rng()));
          PrepareOptions o = chunk_options(path, out, kChunkFixtures + "/" + name);
          o.chunk_bytes = chunk;
          o.threads = threads;
          o.replace_invalid_utf8 = input == "bad.txt";
          const PrepareSummary s = prepare_shards(o);
          if (input == "bad.txt") CHECK(s.num_replaced == 10);  // maximal subparts, as Python's errors="replace"
          const std::string bytes = chunk_shard_bytes(s);
          if (whole.empty()) whole = bytes;  // chunk_bytes 1 GiB: the file in one part
          CHECK(bytes.size() == whole.size());
          CHECK(bytes == whole);
        }
      }
    }
  }
  // Without --invalid-utf8 replace, ill-formed UTF-8 is still named by file, offset and line.
  PrepareOptions o = chunk_options(dir / "bad.txt", dir / "err", kChunkFixtures + "/llama3.tiktoken");
  o.chunk_bytes = 100;
  CHECK_THROWS_WITH(prepare_shards(o), Catch::Contains(dir / "bad.txt") && Catch::Contains("offset 777"));
}
