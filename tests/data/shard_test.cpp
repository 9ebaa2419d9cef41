// Token shards: the llm.c byte layout, round trips, atomic writes and every
// malformed file the reader must refuse with a one-line error naming the file.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "data/shard.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;

namespace {

// A shard built byte by byte (little-endian), independent of write_shard.
std::string shard_bytes(int32_t magic, int32_t version, int32_t count, const std::vector<uint16_t>& tokens) {
  std::string b(1024, '\0');
  auto put32 = [&](size_t at, int32_t v) {
    for (int k = 0; k < 4; ++k) b[at + k] = static_cast<char>(static_cast<uint32_t>(v) >> (8 * k));
  };
  put32(0, magic);
  put32(4, version);
  put32(8, count);
  for (uint16_t t : tokens) {
    b.push_back(static_cast<char>(t & 0xFF));
    b.push_back(static_cast<char>(t >> 8));
  }
  return b;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

using moetrain::testing::error_of;  // the message of the moetrain::Error fn throws

}  // namespace

TEST_CASE("shard: write_shard lays out llm.c's header and uint16 tokens", "[data][shard]") {
  TempDir dir;
  const std::vector<uint16_t> tokens = {0, 1, 50256, 65535, 258, 7};
  write_shard(dir / "a.bin", tokens);
  CHECK(read_bytes(dir / "a.bin") == shard_bytes(20240520, 1, 6, tokens));
  CHECK(list_dir(dir.path()) == std::vector<std::string>{"a.bin"});  // no temporary left behind
}

TEST_CASE("shard: round trips, including empty and odd sizes", "[data][shard]") {
  TempDir dir;
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{33}, size_t{100001}}) {
    std::vector<uint16_t> tokens(n);
    for (size_t i = 0; i < n; ++i) tokens[i] = static_cast<uint16_t>((i * 2654435761u) >> 7);
    const std::string path = dir / fmt::format("r{}.bin", n);
    write_shard(path, tokens);
    TokenShard shard(path);
    CHECK(shard.path() == path);
    CHECK(shard.num_tokens() == static_cast<int64_t>(n));
    const std::vector<uint32_t> ids(tokens.begin(), tokens.end());  // read as uint32, whatever the width
    CHECK(shard.width() == TokenWidth::u16);
    CHECK(shard.read_all() == ids);
    CHECK(read_shard(path) == ids);
    CHECK(std::filesystem::file_size(path) == 1024 + 2 * n);
  }
  // Overwriting replaces the file whole; a moved-from shard is empty.
  write_shard(dir / "r1.bin", std::vector<uint16_t>{9, 8});
  TokenShard a(dir / "r1.bin");
  TokenShard b = std::move(a);
  CHECK(b.num_tokens() == 2);
  CHECK(a.num_tokens() == 0);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  CHECK(b.read_all()[0] == 9);
}

TEST_CASE("shard: a failed write names the file and leaves nothing", "[data][shard][errors]") {
  TempDir dir;
  const std::string path = dir / "missing_dir/x.bin";
  CHECK_THROWS_WITH(write_shard(path, std::vector<uint16_t>{1}),
                    Catch::Contains(path) && Catch::Contains("No such file or directory"));
  CHECK(list_dir(dir.path()).empty());
}

TEST_CASE("shard: malformed files are one-line errors naming the file and offset", "[data][shard][errors]") {
  TempDir dir;
  const std::string path = dir / "train_000000.bin";
  const std::vector<uint16_t> tokens = {1, 2, 3, 4, 5};

  SECTION("missing file") {
    const std::string msg = error_of([&] { TokenShard s(path); });
    CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("No such file"));
  }
  SECTION("a directory") {
    std::filesystem::create_directory(path);
    CHECK_THAT(error_of([&] { TokenShard s(path); }), Catch::Contains(path) && Catch::Contains("not a regular file"));
  }
  SECTION("header only partly there") {
    for (size_t size : {size_t{0}, size_t{12}, size_t{1023}}) {
      write_bytes(path, shard_bytes(20240520, 1, 5, tokens).substr(0, size));
      CHECK_THAT(error_of([&] { TokenShard s(path); }),
                 Catch::Contains(path) && Catch::Contains("truncated header") &&
                     Catch::Contains(std::to_string(size) + " bytes"));
    }
  }
  SECTION("fewer tokens than the header says") {
    write_bytes(path, shard_bytes(20240520, 1, 7, tokens));
    const std::string msg = error_of([&] { TokenShard s(path); });
    CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("truncated") && Catch::Contains("7 tokens") &&
                        Catch::Contains("1038 bytes") && Catch::Contains("1034") && Catch::Contains("offset 8"));
    write_bytes(path, shard_bytes(20240520, 1, 5, tokens).substr(0, 1024 + 9));  // half a token at the end
    CHECK_THAT(error_of([&] { TokenShard s(path); }),
               Catch::Contains("truncated") && Catch::Contains("4 whole tokens"));
  }
  SECTION("more bytes than the header says") {
    write_bytes(path, shard_bytes(20240520, 1, 4, tokens));
    CHECK_THAT(error_of([&] { TokenShard s(path); }),
               Catch::Contains(path) && Catch::Contains("2 trailing bytes at offset 1032"));
  }
  SECTION("wrong magic") {
    write_bytes(path, shard_bytes(12345, 1, 5, tokens));
    CHECK(error_of([&] { TokenShard s(path); }) ==
          path + ": bad magic 12345 at offset 0 (expected 20240520 for uint16 ids or 20240801 for uint32 ids; is "
                 "this an llm.c token shard?)");
    write_bytes(path, std::string(2000, 'x'));  // a text file
    CHECK_THAT(error_of([&] { TokenShard s(path); }), Catch::Contains("bad magic") && Catch::Contains("offset 0"));
  }
  SECTION("wrong version") {
    write_bytes(path, shard_bytes(20240520, 2, 5, tokens));
    CHECK(error_of([&] { TokenShard s(path); }) ==
          path + ": unsupported version 2 at offset 4 (expected 1 with magic 20240520, uint16 ids)");
  }
  SECTION("negative count") {
    write_bytes(path, shard_bytes(20240520, 1, -3, tokens));
    CHECK_THAT(error_of([&] { TokenShard s(path); }), Catch::Contains("negative token count -3 at offset 8"));
  }
  // One line each.
  write_bytes(path + ".bad", shard_bytes(20240520, 1, 9, tokens));
  CHECK(error_of([&] { TokenShard s(path + ".bad"); }).find('\n') == std::string::npos);
}
