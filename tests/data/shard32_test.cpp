// uint32 token shards (llm.c's "llama-3" format: magic 20240801, version 7): the
// byte layout, round trips with ids above 65535, the header checks per width, the
// writer's narrowing to uint16, and the loader reading both widths alike.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "core/error.h"
#include "data/loader.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;

namespace {

// A shard built byte by byte (little-endian), independent of write_shard:
// the header, then each id in `bytes_per_token` bytes.
std::string shard_bytes(int32_t magic, int32_t version, int32_t count, const std::vector<uint32_t>& tokens,
                        int bytes_per_token) {
  std::string b(1024, '\0');
  auto put = [&](size_t at, uint32_t v, int n) {
    for (int k = 0; k < n; ++k) b[at + k] = static_cast<char>(v >> (8 * k));
  };
  put(0, static_cast<uint32_t>(magic), 4);
  put(4, static_cast<uint32_t>(version), 4);
  put(8, static_cast<uint32_t>(count), 4);
  for (uint32_t t : tokens) {
    b.resize(b.size() + bytes_per_token);
    put(b.size() - bytes_per_token, t, bytes_per_token);
  }
  return b;
}

using moetrain::testing::error_of;  // the message of the moetrain::Error fn throws

// n ids spread over [0, limit), with the extremes 0 and limit - 1 and (for a
// limit above it) the uint16 boundary 65535, 65536 among them.
std::vector<uint32_t> spread_ids(size_t n, uint64_t limit) {
  std::vector<uint32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<uint32_t>(((i + 1) * 2654435761ull) % limit);
  const std::vector<uint64_t> marks = {0, limit - 1, 65535, 65536};
  for (size_t k = 0; k < marks.size() && k < n; ++k)
    if (marks[k] < limit) ids[k * 7 % n] = static_cast<uint32_t>(marks[k]);
  return ids;
}

}  // namespace

TEST_CASE("shard32: a uint32 shard has llm.c's version-7 header and round trips ids above 65535", "[data][shard]") {
  TempDir dir;
  const std::vector<uint32_t> ids = {0, 1, 65535, 65536, 69999, 128255, 163839, 4294967295u};
  write_shard(dir / "a.bin", ids, TokenWidth::u32);
  CHECK(read_bytes(dir / "a.bin") == shard_bytes(20240801, 7, 8, ids, 4));
  CHECK(std::filesystem::directory_iterator(dir.path())->path().filename() == "a.bin");  // no temporary left
  TokenShard a(dir / "a.bin");
  CHECK(a.width() == TokenWidth::u32);
  CHECK(a.bytes_per_token() == 4);
  CHECK(a.read_all() == ids);

  for (size_t n : {size_t{0}, size_t{1}, size_t{33}, size_t{100001}}) {
    const std::vector<uint32_t> tokens = spread_ids(std::max<size_t>(n, 1), 200000);
    const std::vector<uint32_t> want(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(n));
    const std::string path = dir / fmt::format("r{}.bin", n);
    write_shard(path, want, TokenWidth::u32);
    CHECK(std::filesystem::file_size(path) == 1024 + 4 * n);
    TokenShard shard(path);
    CHECK(shard.num_tokens() == static_cast<int64_t>(n));
    CHECK(shard.read_all() == want);  // every id
    CHECK(read_shard(path) == want);
    if (n > 1000) CHECK(*std::max_element(want.begin(), want.end()) > 65535);
  }
}

TEST_CASE("shard32: read of any range gives the same ids from a uint16 and a uint32 shard", "[data][shard]") {
  TempDir dir;
  const std::vector<uint32_t> ids = spread_ids(3001, 65536);
  write_shard(dir / "16.bin", ids, TokenWidth::u16);
  write_shard(dir / "32.bin", ids, TokenWidth::u32);
  TokenShard s16(dir / "16.bin"), s32(dir / "32.bin");
  CHECK(s16.width() == TokenWidth::u16);
  CHECK(s32.width() == TokenWidth::u32);
  CHECK(std::filesystem::file_size(dir / "16.bin") == 1024 + 2 * 3001);
  // Ranges at odd and even starts and lengths: the uint16 ids are widened in place.
  for (int64_t first : {0, 1, 2, 999, 3000})
    for (int64_t count : {0, 1, 2, 3, 17, 1000}) {
      if (first + count > 3001) continue;
      std::vector<uint32_t> a(static_cast<size_t>(count) + 1, 0xDEADBEEF), b = a;
      s16.read(first, count, a.data());
      s32.read(first, count, b.data());
      const std::vector<uint32_t> want(ids.begin() + first, ids.begin() + first + count);
      INFO("first " << first << " count " << count);
      CHECK(std::vector<uint32_t>(a.begin(), a.end() - 1) == want);
      CHECK(std::vector<uint32_t>(b.begin(), b.end() - 1) == want);
      CHECK(a.back() == 0xDEADBEEF);  // nothing past the range is written
      CHECK(b.back() == 0xDEADBEEF);
    }
}

TEST_CASE("shard32: write_shard narrows to uint16 only ids that fit, naming the file and offset otherwise",
          "[data][shard][errors]") {
  TempDir dir;
  const std::vector<uint32_t> ids = spread_ids(70000, 65536);  // more than one narrowing block
  write_shard(dir / "n.bin", ids, TokenWidth::u16);
  const std::vector<uint16_t> narrow(ids.begin(), ids.end());
  write_shard(dir / "w.bin", narrow);
  CHECK(read_bytes(dir / "n.bin") == read_bytes(dir / "w.bin"));
  CHECK(read_bytes(dir / "n.bin") == shard_bytes(20240520, 1, 70000, ids, 2));

  std::vector<uint32_t> bad = {1, 2, 3, 65536, 5};
  const std::string path = dir / "bad.bin";
  CHECK(error_of([&] { write_shard(path, bad, TokenWidth::u16); }) ==
        path + ": token id 65536 at token offset 3 does not fit a uint16 shard (ids up to 65535); write a uint32 "
               "shard");
  CHECK(!std::filesystem::exists(path));
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()), {}) == 2);  // no temporary left
}

TEST_CASE("shard32: the width follows the vocabulary", "[data][shard]") {
  CHECK(shard_width_for_vocab(1) == TokenWidth::u16);
  CHECK(shard_width_for_vocab(256) == TokenWidth::u16);
  CHECK(shard_width_for_vocab(50257) == TokenWidth::u16);
  CHECK(shard_width_for_vocab(65536) == TokenWidth::u16);
  CHECK(shard_width_for_vocab(65537) == TokenWidth::u32);
  CHECK(shard_width_for_vocab(128256) == TokenWidth::u32);
  CHECK(shard_width_for_vocab(163840) == TokenWidth::u32);
  CHECK(std::string(token_width_name(TokenWidth::u16)) == "uint16");
  CHECK(std::string(token_width_name(TokenWidth::u32)) == "uint32");
}

TEST_CASE("shard32: malformed uint32 shards are one-line errors naming the file and offset",
          "[data][shard][errors]") {
  TempDir dir;
  const std::string path = dir / "train_000000.bin";
  const std::vector<uint32_t> tokens = {1, 70000, 3, 4, 5};

  SECTION("each magic with the other's version") {
    write_bytes(path, shard_bytes(20240801, 1, 5, tokens, 4));
    CHECK(error_of([&] { TokenShard s(path); }) ==
          path + ": unsupported version 1 at offset 4 (expected 7 with magic 20240801, uint32 ids)");
    write_bytes(path, shard_bytes(20240520, 7, 5, tokens, 2));
    CHECK(error_of([&] { TokenShard s(path); }) ==
          path + ": unsupported version 7 at offset 4 (expected 1 with magic 20240520, uint16 ids)");
  }
  SECTION("a uint32 header over uint16 data: too short for its width") {
    write_bytes(path, shard_bytes(20240801, 7, 5, tokens, 2));
    CHECK(error_of([&] { TokenShard s(path); }) ==
          path + ": truncated: the header says 5 tokens (offset 8) of 4 bytes (uint32), so the file should have "
                 "1044 bytes, but it has 1034 (the data ends at byte offset 1034, after 2 whole tokens)");
  }
  SECTION("a uint16 header over uint32 data: trailing bytes") {
    write_bytes(path, shard_bytes(20240520, 1, 5, tokens, 4));
    CHECK(error_of([&] { TokenShard s(path); }) ==
          path + ": 10 trailing bytes at offset 1034: the header says 5 tokens (offset 8) of 2 bytes (uint16), so the "
                 "file should have 1034 bytes, but it has 1044");
  }
  SECTION("truncated in the last token") {
    write_bytes(path, shard_bytes(20240801, 7, 5, tokens, 4).substr(0, 1024 + 18));
    CHECK_THAT(error_of([&] { TokenShard s(path); }),
               Catch::Contains(path) && Catch::Contains("truncated") && Catch::Contains("1044 bytes") &&
                   Catch::Contains("it has 1042") && Catch::Contains("4 whole tokens"));
  }
  SECTION("truncated header, negative count") {
    write_bytes(path, shard_bytes(20240801, 7, 5, tokens, 4).substr(0, 12));
    CHECK_THAT(error_of([&] { TokenShard s(path); }), Catch::Contains(path) && Catch::Contains("truncated header"));
    write_bytes(path, shard_bytes(20240801, 7, -2, tokens, 4));
    CHECK(error_of([&] { TokenShard s(path); }) == path + ": negative token count -2 at offset 8");
  }
  // One line each.
  write_bytes(path + ".bad", shard_bytes(20240801, 7, 9, tokens, 4));
  CHECK(error_of([&] { TokenShard s(path + ".bad"); }).find('\n') == std::string::npos);
}

TEST_CASE("shard32: a uint32 shard truncated while in use names the file and its size at open", "[data][shard]") {
  TempDir dir;
  const std::string path = dir / "s.bin";
  write_shard(path, spread_ids(1000, 100000), TokenWidth::u32);
  TokenShard shard(path);
  std::filesystem::resize_file(path, 1024 + 4 * 100);
  std::vector<uint32_t> out(10);
  std::string message;
  try {
    shard.read(500, 10, out.data());
  } catch (const IoError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains(path) && Catch::Contains("truncated while in use") &&
                          Catch::Contains("byte offset 3024") &&
                          Catch::Contains("1424 bytes now, 5024 when it was opened"));
}

TEST_CASE("shard32: the loader yields the same windows and batches from uint16 and uint32 shards of the same ids",
          "[data][loader]") {
  TempDir dir;
  std::filesystem::create_directories(dir / "16");
  std::filesystem::create_directories(dir / "32");
  const std::vector<uint32_t> a = spread_ids(1000, 65536), b = spread_ids(537, 60000);
  write_shard(dir / "16/train_000000.bin", a, TokenWidth::u16);
  write_shard(dir / "16/train_000001.bin", b, TokenWidth::u16);
  write_shard(dir / "32/train_000000.bin", a, TokenWidth::u32);
  write_shard(dir / "32/train_000001.bin", b, TokenWidth::u32);
  for (LoaderOrder order : {LoaderOrder::shuffled, LoaderOrder::sequential}) {
    DataLoaderOptions o;
    o.batch_size = 3;
    o.seq_len = 10;
    o.vocab_size = 65536;
    o.seed = 7;
    o.order = order;
    DataLoader l16(dir / "16/train_*.bin", o), l32(dir / "32/train_*.bin", o);
    REQUIRE(l16.num_windows() == 152);
    CHECK(l32.num_windows() == l16.num_windows());
    CHECK(l32.num_tokens() == 1537);
    std::vector<uint32_t> w16(11), w32(11);
    for (int64_t w = 0; w < l16.num_windows(); ++w) {
      l16.window_tokens(w, w16.data());
      l32.window_tokens(w, w32.data());
      REQUIRE(w16 == w32);
    }
    // Two epochs of batches (152 / 3 = 50 batches per epoch, the last straddling), bit for bit.
    for (int i = 0; i < 110; ++i) {
      const Batch x = l16.next(), y = l32.next();
      REQUIRE(x.inputs.to_vector() == y.inputs.to_vector());
      REQUIRE(x.targets.to_vector() == y.targets.to_vector());
    }
    CHECK(l16.state() == l32.state());
  }
}

TEST_CASE("shard32: the loader reads ids above 65535 and refuses ids outside model.vocab_size naming the file",
          "[data][loader][errors]") {
  TempDir dir;
  std::vector<uint32_t> ids = spread_ids(500, 70000);
  const std::string good = dir / "good.bin", bad = dir / "bad.bin";
  write_shard(good, ids, TokenWidth::u32);
  DataLoaderOptions o;
  o.batch_size = 49;
  o.seq_len = 10;
  o.vocab_size = 70000;
  o.order = LoaderOrder::sequential;
  DataLoader loader(good, o);
  REQUIRE(loader.num_windows() == 49);
  const Batch batch = loader.next();  // all 49 windows: ids 0..489 as inputs, 1..490 as targets
  const std::vector<double> inputs = batch.inputs.to_vector(), targets = batch.targets.to_vector();
  for (size_t i = 0; i < inputs.size(); ++i) {
    REQUIRE(inputs[i] == ids[i]);
    REQUIRE(targets[i] == ids[i + 1]);
  }
  CHECK(*std::max_element(inputs.begin(), inputs.end()) == 69999);

  ids[123] = 70000;
  ids[400] = 4294967295u;
  write_shard(bad, ids, TokenWidth::u32);
  CHECK(error_of([&] { DataLoader l(std::vector<std::string>{good, bad}, o); }) ==
        bad + ": token id 70000 at token offset 123 (byte offset 1516) is outside the vocabulary [0, 70000); was the "
              "shard made with another tokenizer?");
  o.vocab_size = std::numeric_limits<int32_t>::max();
  CHECK_THAT(error_of([&] { DataLoader l(bad, o); }),
             Catch::Contains(bad) && Catch::Contains("token id 4294967295 at token offset 400"));
  // Batches hold int32 ids: a vocabulary beyond that is refused, never wrapped.
  o.vocab_size = int64_t{1} << 31;
  CHECK_THAT(error_of([&] { DataLoader l(good, o); }),
             Catch::Contains("vocab_size = 2147483648 must be in [1, 2147483647]"));
}

TEST_CASE("shard32: a vocabulary above 65536 reads uint16 shards unless the tokenizer needs uint32",
          "[data][loader][errors]") {
  TempDir dir;
  const std::string s16 = dir / "s16.bin", s32 = dir / "s32.bin";
  write_shard(s16, spread_ids(200, 256), TokenWidth::u16);
  write_shard(s32, spread_ids(200, 256), TokenWidth::u32);
  DataLoaderOptions o;
  o.batch_size = 1;
  o.seq_len = 10;
  o.vocab_size = 70000;  // a padded or oversized model.vocab_size: the ids fit, the shard's width does not matter
  CHECK(DataLoader(s16, o).num_windows() == 19);
  o.tokenizer_vocab_size = 256;  // a small tokenizer may write either width (uint32: only wasteful)
  CHECK(DataLoader(s16, o).num_windows() == 19);
  CHECK(DataLoader(s32, o).num_windows() == 19);
  o.tokenizer_vocab_size = 70000;  // its shards are uint32: a uint16 one came from another tokenizer
  CHECK(DataLoader(s32, o).num_windows() == 19);
  CHECK(error_of([&] { DataLoader l(std::vector<std::string>{s32, s16}, o); }) ==
        s16 + ": a uint16 token shard (magic 20240520 at offset 0), but the tokenizer has 70000 ids, more than uint16 "
              "holds: the shard was made with another tokenizer; run `moetrain prepare` with this one (it writes "
              "uint32 shards)");
}

TEST_CASE("shard32: prepare writes uint16 shards for a tokenizer of at most 65536 ids", "[data][prepare]") {
  TempDir dir;
  write_bytes(dir / "a.txt", "to be or not to be, that is the question\n");
  PrepareOptions o;
  o.inputs = {dir / "a.txt"};
  o.out_dir = dir / "out";
  o.tokenizer = "byte";
  o.val_tokens = 8;
  o.progress.mode = ProgressOptions::Mode::off;
  const PrepareSummary s = prepare_shards(o);
  CHECK(s.width == TokenWidth::u16);
  REQUIRE(s.shards.size() == 2);
  for (const PreparedShard& shard : s.shards) {
    CHECK(TokenShard(shard.path).width() == TokenWidth::u16);
    CHECK(read_bytes(shard.path).substr(0, 8) == shard_bytes(20240520, 1, 0, {}, 2).substr(0, 8));
  }
  std::vector<uint32_t> all = read_shard(s.shards[0].path), train = read_shard(s.shards[1].path);
  all.insert(all.end(), train.begin(), train.end());
  const std::string text = read_bytes(dir / "a.txt");
  CHECK(all == std::vector<uint32_t>(text.begin(), text.end()));
}
