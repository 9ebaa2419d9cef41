// Safetensors reader and writer: round trips of every dtype and shape, the exact
// bytes of a small file (built by hand), every malformed file the reader must reject
// (bytes written by hand), atomic writes, and files exchanged with an independent
// reader/writer (tests/reference/safetensors_read.py: json, struct and numpy only).
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
namespace fs = std::filesystem;

using moetrain::testing::read_bytes;
using moetrain::testing::TempDir;
using moetrain::testing::write_bytes;

namespace {

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file as bytes: length, header (unpadded, as given), data.
std::string st_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// One tensor entry for hand-built headers.
std::string st_entry(const std::string& name, const std::string& dtype, const std::string& shape, int64_t begin,
                     int64_t end) {
  return fmt::format(R"("{}":{{"dtype":"{}","shape":{},"data_offsets":[{},{}]}})", name, dtype, shape, begin, end);
}

// A JSON object from its members: {members}.
std::string object(const std::string& members) { return fmt::format("{{{}}}", members); }

// Opens `path`, REQUIREs a moetrain::Error whose one-line message names the file and
// holds every `needles` string.
void check_rejected(const std::string& path, const std::vector<std::string>& needles) {
  try {
    SafetensorsFile::open(path);
    FAIL("opened without an error");
  } catch (const Error& e) {
    std::string message = e.what();
    INFO("message: " << message);
    CHECK(message.find(path) != std::string::npos);
    CHECK(message.find('\n') == std::string::npos);
    for (const std::string& needle : needles) {
      INFO("expected to contain: " << needle);
      CHECK(message.find(needle) != std::string::npos);
    }
  }
}

// Values as comparable strings: integers exactly, floats as shortest round-trip
// decimals, non-finite as "nan"/"inf"/"-inf" (the reference script's convention).
std::string float_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{}", v);
}

std::vector<std::string> tensor_texts(const Tensor& t) {
  std::vector<std::string> out;
  auto add_all = [&](auto* p, auto convert) {
    for (int64_t i = 0; i < t.numel(); ++i) out.push_back(convert(p[i]));
  };
  switch (t.dtype()) {
    case DType::f32: add_all(t.data<float>(), [](float v) { return float_text(v); }); break;
    case DType::f64: add_all(t.data<double>(), [](double v) { return float_text(v); }); break;
    case DType::bf16: add_all(t.data<bf16>(), [](bf16 v) { return float_text(v.to_float()); }); break;
    case DType::i32: add_all(t.data<int32_t>(), [](int32_t v) { return std::to_string(v); }); break;
    case DType::i64: add_all(t.data<int64_t>(), [](int64_t v) { return std::to_string(v); }); break;
    case DType::u16: add_all(t.data<uint16_t>(), [](uint16_t v) { return std::to_string(v); }); break;
  }
  return out;
}

std::vector<std::string> json_texts(const nlohmann::json& values) {
  std::vector<std::string> out;
  for (const auto& v : values) {
    if (v.is_string()) out.push_back(v.get<std::string>());
    else if (v.is_number_unsigned()) out.push_back(std::to_string(v.get<uint64_t>()));
    else if (v.is_number_integer()) out.push_back(std::to_string(v.get<int64_t>()));
    else out.push_back(float_text(v.get<double>()));
  }
  return out;
}

// Runs tests/reference/safetensors_read.py with `args`; REQUIREs exit status 0.
void run_reference(const TempDir& dir, const std::string& args) {
  std::string log = dir.file("reference.log");
  std::string command = fmt::format("/usr/bin/python3 '{}/tests/reference/safetensors_read.py' {} >'{}' 2>&1",
                                    MOETRAIN_SOURCE_DIR, args, log);
  int status = std::system(command.c_str());
  INFO(command << "\n" << read_bytes(log)
               << "(needs /usr/bin/python3 with numpy: Debian package python3-numpy, see launch/setup.sh)");
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
}

nlohmann::json load_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

// Tensors of every dtype: random values, the extremes of each type, and the shapes
// that are easy to get wrong (rank 0, an empty dim, rank 8).
std::vector<std::pair<std::string, Tensor>> sample_tensors() {
  std::vector<std::pair<std::string, Tensor>> out;
  Generator gen(5);
  std::vector<Shape> shapes = {Shape{}, Shape{0}, Shape{5}, Shape{2, 0, 3}, Shape{3, 4}, Shape{1, 2, 1, 2, 1, 2, 1, 2}};
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::u16}) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      Tensor t = is_floating(dtype) ? randn(shapes[s], dtype, gen)
                                    : randint(shapes[s], dtype == DType::u16 ? 65536 : 1000, dtype, gen);
      out.emplace_back(fmt::format("{}.shape{}", dtype_name(dtype), s), t);
    }
  }
  const double inf = std::numeric_limits<double>::infinity();
  out.emplace_back("f32.special", from_vector({-0.0, inf, -inf, 1e-45, 3.4028234663852886e38}, {5}, DType::f32));
  out.emplace_back("f64.special", from_vector({-0.0, inf, -inf, 5e-324, 1.7976931348623157e308}, {5}, DType::f64));
  std::vector<bf16> bf16_bits = {{0x8000}, {0x7f80}, {0xff80}, {0x0001}, {0x7f7f}};
  out.emplace_back("bf16.special", from_span<bf16>(bf16_bits, {5}));
  std::vector<int32_t> i32 = {INT32_MIN, -1, 0, 1, INT32_MAX};
  out.emplace_back("i32.extremes", from_span<int32_t>(i32, {5}));
  std::vector<int64_t> i64 = {INT64_MIN, -1, 0, (int64_t{1} << 53) + 1, INT64_MAX};
  out.emplace_back("i64.extremes", from_span<int64_t>(i64, {5}));
  std::vector<uint16_t> u16 = {0, 1, 32768, 65534, 65535};
  out.emplace_back("u16.extremes", from_span<uint16_t>(u16, {5}));
  return out;
}

}  // namespace

TEST_CASE("safetensors: every dtype and shape round-trips bit for bit, in order", "[checkpoint][safetensors]") {
  TempDir dir;
  std::string path = dir.file("all.safetensors");
  auto tensors = sample_tensors();
  write_safetensors(path, tensors);

  SafetensorsFile file = SafetensorsFile::open(path);
  REQUIRE(file.entries().size() == tensors.size());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    INFO(name);
    const TensorEntry& e = file.entries()[i];  // data order = the order given
    CHECK(e.name == name);
    CHECK(e.dtype == t.dtype());
    CHECK(e.shape == t.shape());
    CHECK(e.begin == offset);
    CHECK(e.end == offset + t.nbytes());
    offset = e.end;
    CHECK(&file.entry(name) == &e);
    Tensor back = file.read(name);
    CHECK(back.is_cpu());
    CHECK(bitwise_equal(back, t));
  }
  CHECK(file.entry("bf16.shape0").dtype_name == "BF16");
  CHECK(file.entry("u16.shape2").dtype_name == "U16");
  // The data starts 8-byte aligned, right after the header.
  std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  CHECK(bytes.size() == 8 + n + static_cast<uint64_t>(offset));

  // A copy shares the descriptor and keeps working after the original is gone.
  SafetensorsFile copy = file;
  file = SafetensorsFile::open(path);
  CHECK(bitwise_equal(copy.read("i64.extremes"), tensors[tensors.size() - 2].second));
}

TEST_CASE("safetensors: metadata round-trips; format pt is added unless given", "[checkpoint][safetensors]") {
  TempDir dir;
  std::string path = dir.file("meta.safetensors");
  write_safetensors(path, {{"x", ones({2})}}, {{"step", "30"}, {"note", "ünïcödé \"quoted\"\nline"}});
  std::map<std::string, std::string> expected = {
      {"format", "pt"}, {"step", "30"}, {"note", "ünïcödé \"quoted\"\nline"}};
  CHECK(SafetensorsFile::open(path).metadata() == expected);

  write_safetensors(path, {{"x", ones({2})}}, {{"format", "mlx"}});
  CHECK(SafetensorsFile::open(path).metadata() == std::map<std::string, std::string>{{"format", "mlx"}});

  write_safetensors(path, {});  // no tensors at all: a header and nothing else
  SafetensorsFile empty_file = SafetensorsFile::open(path);
  CHECK(empty_file.entries().empty());
  CHECK(empty_file.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK(read_bytes(path) == le64(32) + R"({"__metadata__":{"format":"pt"}})");
}

TEST_CASE("safetensors: the writer's bytes match a hand-built file", "[checkpoint][safetensors]") {
  TempDir dir;
  std::string path = dir.file("small.safetensors");
  std::vector<uint16_t> u = {1, 2, 0xabcd};
  write_safetensors(path, {{"w", from_vector({1.0, -2.0}, {2}, DType::f32)},
                           {"n", from_vector({-1}, {}, DType::i64)},
                           {"u", from_span<uint16_t>(u, {3})}});
  // 193 bytes of JSON + 7 spaces = N = 200 = 0xc8, so the data starts at byte 208.
  std::string expected = std::string("\xc8\0\0\0\0\0\0\0", 8) +
                         R"({"__metadata__":{"format":"pt"},)"
                         R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("n":{"dtype":"I64","shape":[],"data_offsets":[8,16]},)"
                         R"("u":{"dtype":"U16","shape":[3],"data_offsets":[16,22]}})"
                         "       " +
                         std::string("\x00\x00\x80\x3f" "\x00\x00\x00\xc0", 8) +  // 1.0f, -2.0f
                         std::string(8, '\xff') +                                   // int64 -1
                         std::string("\x01\x00" "\x02\x00" "\xcd\xab", 6);          // u16 1, 2, 0xabcd
  REQUIRE(expected.size() == 230);
  CHECK(read_bytes(path) == expected);
}

TEST_CASE("safetensors: F16 is read as f32, exactly", "[checkpoint][safetensors]") {
  TempDir dir;
  std::string path = dir.file("f16.safetensors");
  // 1, -2, max, min subnormal, max subnormal, min normal, -0, inf, -inf, NaN, 0.333...
  std::vector<uint16_t> bits = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x03ff, 0x0400,
                                0x8000, 0x7c00, 0xfc00, 0x7e00, 0x3555};
  std::string data;
  for (uint16_t b : bits) data += std::string{static_cast<char>(b & 0xff), static_cast<char>(b >> 8)};
  write_bytes(path, st_file(object(st_entry("h", "F16", "[11]", 0, 22)), data));

  SafetensorsFile file = SafetensorsFile::open(path);
  CHECK(file.entry("h").dtype_name == "F16");
  CHECK(file.entry("h").dtype == DType::f32);
  CHECK(file.entry("h").nbytes() == 22);
  Tensor t = file.read("h");
  REQUIRE(t.dtype() == DType::f32);
  REQUIRE(t.shape() == Shape{11});
  const float* v = t.data<float>();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> expected = {1.0f, -2.0f, 65504.0f, 5.9604644775390625e-08f, 6.097555160522461e-05f,
                                 6.103515625e-05f, -0.0f, inf, -inf};
  for (size_t i = 0; i < expected.size(); ++i) CHECK(v[i] == expected[i]);
  CHECK(std::signbit(v[6]));
  CHECK(std::isnan(v[9]));
  CHECK(v[10] == 0.333251953125f);
}

TEST_CASE("safetensors: malformed files are rejected, naming the file and the problem",
          "[checkpoint][safetensors][errors]") {
  TempDir dir;
  const std::string a8 = st_entry("a", "F32", "[2]", 0, 8);  // a valid 8-byte entry
  struct Case {
    const char* name;
    std::string bytes;
    std::vector<std::string> needles;
  };
  std::vector<Case> cases = {
      {"shorter than 8 bytes", std::string("\x02\0\0", 3), {"3 bytes", "shorter than the 8-byte header length"}},
      {"header too large", le64(100'000'001) + "{}", {"header length 100000001", "limit of 100000000 bytes"}},
      {"header past the end", le64(64) + "{}", {"header length 64", "would end at byte 72", "file is 10 bytes"}},
      {"not JSON", st_file(R"({"a":{"dtype":"F32",})", ""),
       {"not valid JSON", "header byte 21", "file offset 28"}},
      {"not UTF-8", st_file("{\"a\xff\":{}}", ""), {"not valid JSON", "UTF-8"}},
      {"not an object", st_file("[1,2]", ""), {"is a JSON array, expected an object"}},
      {"leading space", st_file(" {}", ""), {"must start with '{' at file offset 8", "0x20"}},
      {"duplicate tensor", st_file(object(a8 + "," + a8), std::string(8, '\0')),
       {"duplicate key \"a\" in the header"}},
      {"duplicate field",
       st_file(R"({"a":{"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
       {"duplicate key \"dtype\" inside \"a\""}},
      {"duplicate metadata key", st_file(R"({"__metadata__":{"k":"1","k":"2"}})", ""),
       {"duplicate key \"k\" inside \"__metadata__\""}},
      {"entry not an object", st_file(R"({"a":[1]})", ""), {"tensor \"a\": entry is [1]"}},
      {"missing dtype", st_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
       {"tensor \"a\"", "no \"dtype\" field"}},
      {"missing shape", st_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", std::string(8, '\0')),
       {"tensor \"a\"", "no \"shape\" field"}},
      {"missing data_offsets", st_file(R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, '\0')),
       {"tensor \"a\"", "no \"data_offsets\" field"}},
      {"dtype not a string", st_file(R"({"a":{"dtype":32,"shape":[2],"data_offsets":[0,8]}})", ""),
       {"tensor \"a\": \"dtype\" is 32, expected a string"}},
      {"shape not an array", st_file(object(st_entry("a", "F32", "\"2\"", 0, 8)), std::string(8, '\0')),
       {"tensor \"a\": \"shape\" is \"2\", expected an array"}},
      {"fractional extent", st_file(object(st_entry("a", "F32", "[1.5]", 0, 8)), std::string(8, '\0')),
       {"tensor \"a\": shape[0] is 1.5, expected a non-negative integer"}},
      {"negative extent", st_file(object(st_entry("a", "F32", "[2,-3]", 0, 8)), std::string(8, '\0')),
       {"tensor \"a\": shape[1] is negative (-3)"}},
      {"rank 9", st_file(object(st_entry("a", "F32", "[1,1,1,1,1,1,1,1,2]", 0, 8)), std::string(8, '\0')),
       {"tensor \"a\"", "rank 9", "at most 8 dims"}},
      {"element count overflows", st_file(object(st_entry("a", "F32", "[4611686018427387904,4]", 0, 8)), ""),
       {"tensor \"a\"", "more than 2^63 elements"}},
      {"one offset", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", ""),
       {"tensor \"a\": \"data_offsets\" is [0], expected [BEGIN, END]"}},
      {"offset not a number", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":["0",8]}})", ""),
       {"tensor \"a\": data_offsets[0] (BEGIN) is \"0\""}},
      {"negative offset", st_file(object(st_entry("a", "F32", "[2]", -8, 0)), ""),
       {"tensor \"a\": data_offsets[0] (BEGIN) is negative (-8)"}},
      {"offset over 2^63", st_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,18446744073709551615]}})", ""),
       {"tensor \"a\": data_offsets[1] (END) = 18446744073709551615 is too large"}},
      {"END before BEGIN", st_file(object(st_entry("a", "F32", "[0]", 8, 0)), ""),
       {"tensor \"a\": data_offsets [8, 0] end before they begin"}},
      {"size mismatch", st_file(object(st_entry("a", "F32", "[2]", 0, 4)), std::string(4, '\0')),
       {"tensor \"a\": data_offsets [0, 4] span 4 bytes, but F32 [2] needs 8"}},
      {"unsupported dtype", st_file(object(st_entry("a", "BOOL", "[2]", 0, 2)), std::string(2, '\0')),
       {"tensor \"a\" has dtype \"BOOL\"", "does not support", "F32, F64, BF16, F16, I32, I64 and U16"}},
      {"unknown dtype", st_file(object(st_entry("a", "Q4_K", "[2]", 0, 2)), std::string(2, '\0')),
       {"tensor \"a\" has dtype \"Q4_K\"", "not a safetensors dtype"}},
      {"metadata not an object", st_file(R"({"__metadata__":"pt"})", ""),
       {"\"__metadata__\" is \"pt\", expected an object of strings"}},
      {"metadata value not a string", st_file(R"({"__metadata__":{"format":1}})", ""),
       {"\"__metadata__\" value of \"format\" is 1, expected a string"}},
  };
  // Layout errors: the data buffer starts at 8 + N, so file offsets are checked too.
  {
    std::string header = object(st_entry("a", "F32", "[2]", 4, 12));
    cases.push_back({"first tensor not at 0", st_file(header, std::string(12, '\0')),
                     {"tensor \"a\" starts at data offset 4", fmt::format("(file offset {})", 8 + header.size() + 4),
                      "must start at data offset 0"}});
  }
  {
    std::string header = object(st_entry("b", "F32", "[2]", 12, 20) + "," + a8);  // key order means nothing
    cases.push_back({"hole", st_file(header, std::string(20, '\0')),
                     {fmt::format("hole of 4 bytes at file offset {}", 8 + header.size() + 8),
                      "between tensor \"a\" (data_offsets [0, 8]) and tensor \"b\" (data_offsets [12, 20])"}});
  }
  {
    std::string header = object(a8 + "," + st_entry("b", "F32", "[2]", 4, 12));
    cases.push_back({"overlap", st_file(header, std::string(12, '\0')),
                     {"tensor \"b\" (data_offsets [4, 12]) overlaps tensor \"a\" (data_offsets [0, 8])",
                      fmt::format("at file offset {}", 8 + header.size() + 4)}});
  }
  {
    std::string header = object(a8);
    cases.push_back({"trailing bytes", st_file(header, std::string(10, '\0')),
                     {"2 trailing bytes", fmt::format("ends at file offset {}", 8 + header.size() + 8),
                      fmt::format("file is {} bytes", 8 + header.size() + 10)}});
    cases.push_back({"truncated data", st_file(header, std::string(6, '\0')),
                     {"data buffer truncated: tensor \"a\"", fmt::format("ends at file offset {}", 8 + header.size() + 8),
                      fmt::format("only {} bytes", 8 + header.size() + 6)}});
    cases.push_back({"trailing bytes, no tensors", st_file("{}", "xyz"), {"3 trailing bytes"}});
  }

  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      std::string path = dir.file("bad.safetensors");
      write_bytes(path, c.bytes);
      check_rejected(path, c.needles);
    }
  }

  SECTION("missing file") {
    check_rejected(dir.file("absent.safetensors"), {"cannot open a safetensors file", "No such file"});
  }
  SECTION("a directory") { check_rejected(dir.path(), {"not a regular file"}); }
}

TEST_CASE("safetensors: an unknown name lists similar names the file holds", "[checkpoint][safetensors][errors]") {
  TempDir dir;
  std::string path = dir.file("names.safetensors");
  write_safetensors(path, {{"wte.weight", zeros({4, 2})},
                           {"h.0.attn.c_attn.weight", zeros({2, 6})},
                           {"h.0.attn.c_proj.weight", zeros({2, 2})},
                           {"h.0.mlp.c_fc.weight", zeros({2, 8})},
                           {"ln_f.bias", zeros({2})}});
  SafetensorsFile file = SafetensorsFile::open(path);
  CHECK(file.contains("ln_f.bias"));
  CHECK_FALSE(file.contains("h.0.attn.weight"));
  CHECK_THROWS_WITH(file.entry("h.0.attn.weight"),
                    Catch::Contains(path) && Catch::Contains("no tensor \"h.0.attn.weight\"") &&
                        Catch::Contains("holds 5 tensors") &&
                        Catch::Contains("\"h.0.attn.c_attn.weight\", \"h.0.attn.c_proj.weight\", "
                                        "\"h.0.mlp.c_fc.weight\""));
  CHECK_THROWS_WITH(file.read("lm_head.weight"), Catch::Contains("no tensor \"lm_head.weight\""));
}

TEST_CASE("safetensors: a failed write leaves no file at the target and no temp file",
          "[checkpoint][safetensors][errors]") {
  TempDir dir;
  std::vector<std::pair<std::string, Tensor>> good = {{"a", ones({3})}};

  SECTION("the target directory does not exist") {
    std::string path = dir.file("missing_dir/out.safetensors");
    CHECK_THROWS_WITH(write_safetensors(path, good),
                      Catch::Contains("writing safetensors file " + path) && Catch::Contains("cannot create") &&
                          Catch::Contains("No such file or directory"));
    CHECK(dir.listing().empty());
  }
  SECTION("the rename fails (the target is a directory)") {
    std::string path = dir.file("a_directory");
    fs::create_directory(path);
    CHECK_THROWS_WITH(write_safetensors(path, good), Catch::Contains(path) && Catch::Contains("renaming"));
    CHECK(dir.listing() == std::vector<std::string>{"a_directory"});  // temp file removed
    CHECK(fs::is_directory(path));
  }
  SECTION("bad arguments leave an existing file untouched") {
    std::string path = dir.file("out.safetensors");
    write_safetensors(path, good);
    std::string before = read_bytes(path);
    CHECK_THROWS_WITH(write_safetensors(path, {{"x", ones({1})}, {"y", ones({1})}, {"x", ones({2})}}),
                      Catch::Contains(path) && Catch::Contains("tensor name \"x\" appears twice"));
    CHECK_THROWS_WITH(write_safetensors(path, {{"__metadata__", ones({1})}}),
                      Catch::Contains(path) && Catch::Contains("reserved"));
    CHECK_THROWS_WITH(write_safetensors(path, {{"u", Tensor()}}), Catch::Contains("tensor \"u\" is undefined"));
    CHECK_THROWS_WITH(write_safetensors(path, {{"bad\xff", ones({1})}}), Catch::Contains("not valid UTF-8"));
    CHECK(read_bytes(path) == before);
    CHECK(dir.listing() == std::vector<std::string>{"out.safetensors"});
  }
  SECTION("a successful write replaces the file and leaves nothing else") {
    std::string path = dir.file("out.safetensors");
    write_safetensors(path, good);
    write_safetensors(path, {{"b", full({2}, 7.0, DType::f64)}});
    CHECK(dir.listing() == std::vector<std::string>{"out.safetensors"});
    SafetensorsFile file = SafetensorsFile::open(path);
    CHECK_FALSE(file.contains("a"));
    CHECK(file.read("b").to_vector() == std::vector<double>{7.0, 7.0});
  }
}

TEST_CASE("safetensors: an independent reader (numpy) reads what we write", "[checkpoint][safetensors]") {
  // bf16.special holds a subnormal, compared by value (tensor_texts widens it).
  const moetrain::testing::KeepDenormals keep;
  TempDir dir;
  std::string path = dir.file("ours.safetensors"), out = dir.file("read.json");
  auto tensors = sample_tensors();
  write_safetensors(path, tensors, {{"model", "gpt2"}});
  run_reference(dir, fmt::format("read '{}' '{}'", path, out));

  nlohmann::json result = load_json(out);
  CHECK(result["data_start"].get<int64_t>() % 8 == 0);
  CHECK(result["metadata"] == nlohmann::json({{"format", "pt"}, {"model", "gpt2"}}));
  REQUIRE(result["tensors"].size() == tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    const nlohmann::json& r = result["tensors"][i];  // in data order
    INFO(name);
    CHECK(r["name"] == name);
    std::string dtype_upper(dtype_name(t.dtype()));
    for (char& c : dtype_upper) c = static_cast<char>(std::toupper(c));
    CHECK(r["dtype"] == dtype_upper);
    CHECK(r["shape"].get<std::vector<int64_t>>() == t.shape().vec());
    CHECK(json_texts(r["values"]) == tensor_texts(t));
  }
}

TEST_CASE("safetensors: we read what an independent writer (numpy) wrote", "[checkpoint][safetensors]") {
  TempDir dir;
  std::string spec = dir.file("spec.json"), path = dir.file("theirs.safetensors"), values = dir.file("values.json");
  write_bytes(spec, R"({"seed": 1234, "metadata": {"format": "pt", "written_by": "numpy"},
    "tensors": [
      {"name": "wte.weight", "dtype": "F32", "shape": [7, 5]},
      {"name": "h.0.ln_1.weight", "dtype": "F64", "shape": [5]},
      {"name": "h.0.attn.c_attn.weight", "dtype": "BF16", "shape": [5, 15]},
      {"name": "half", "dtype": "F16", "shape": [3, 11]},
      {"name": "half.special", "dtype": "F16", "shape": [6], "values": [1.0, "nan", "inf", "-inf", -0.0, 6e-08]},
      {"name": "tokens", "dtype": "U16", "shape": [2, 9]},
      {"name": "ids32", "dtype": "I32", "shape": [4]},
      {"name": "ids64", "dtype": "I64", "shape": [4]},
      {"name": "scalar", "dtype": "F32", "shape": []},
      {"name": "empty", "dtype": "I64", "shape": [3, 0]}
    ]})");
  run_reference(dir, fmt::format("write '{}' '{}' '{}'", spec, path, values));

  nlohmann::json expected = load_json(values);
  SafetensorsFile file = SafetensorsFile::open(path);
  CHECK(file.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"written_by", "numpy"}});
  REQUIRE(file.entries().size() == expected["tensors"].size());
  for (const nlohmann::json& x : expected["tensors"]) {
    std::string name = x["name"];
    INFO(name);
    REQUIRE(file.contains(name));
    const TensorEntry& e = file.entry(name);
    CHECK(e.dtype_name == x["dtype"]);
    CHECK(e.begin == x["data_offsets"][0].get<int64_t>());
    CHECK(e.end == x["data_offsets"][1].get<int64_t>());
    Tensor t = file.read(name);
    CHECK(t.shape().vec() == x["shape"].get<std::vector<int64_t>>());
    CHECK(json_texts(x["values"]) == tensor_texts(t));
  }
  CHECK(file.read("half").dtype() == DType::f32);
  CHECK(file.read("tokens").dtype() == DType::u16);
  // 6e-08 rounds to the subnormal 2^-24 in F16.
  CHECK(file.read("half.special").data<float>()[5] == 5.9604644775390625e-08f);
}
