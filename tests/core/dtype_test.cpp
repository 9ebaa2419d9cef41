// DType properties and bfloat16: round to nearest even, NaN and infinity
// handling, and conversions through Tensor::to. Expected bits are derived here
// from the IEEE layout, never from bf16::from_float.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "moetrain.h"
#include "testing.h"

using namespace moetrain;

namespace {

float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Reference bf16 rounding by value: the two bf16 neighbours of f (as f32 with
// the low 16 bits cleared / rounded up) and a comparison of distances in double.
uint16_t bf16_ref(float f) {
  uint32_t u = bits_of(f);
  uint32_t down = u & 0xffff0000u, up = down + 0x10000u;
  double dv = float_from_bits(down), x = f;
  double uv = (up & 0x7f800000u) == 0x7f800000u && (down & 0x7f800000u) != 0x7f800000u
                  ? std::copysign(std::ldexp(1.0, 128), x)  // past the largest finite: the next step is 2^128
                  : static_cast<double>(float_from_bits(up));
  double ddown = std::abs(x - dv), dup = std::abs(uv - x);
  if (ddown < dup) return static_cast<uint16_t>(down >> 16);
  if (dup < ddown) return static_cast<uint16_t>(up >> 16);
  return ((down >> 16) & 1u) == 0 ? static_cast<uint16_t>(down >> 16) : static_cast<uint16_t>(up >> 16);
}

}  // namespace

TEST_CASE("dtype: sizes, names and kinds", "[core][dtype]") {
  CHECK(dtype_size(DType::f32) == 4);
  CHECK(dtype_size(DType::f64) == 8);
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::i32) == 4);
  CHECK(dtype_size(DType::i64) == 8);
  CHECK(dtype_size(DType::u16) == 2);
  CHECK(sizeof(bf16) == 2);
  CHECK(dtype_name(DType::f32) == "f32");
  CHECK(dtype_name(DType::f64) == "f64");
  CHECK(dtype_name(DType::bf16) == "bf16");
  CHECK(dtype_name(DType::i32) == "i32");
  CHECK(dtype_name(DType::i64) == "i64");
  CHECK(dtype_name(DType::u16) == "u16");
  CHECK(fmt::format("{}", DType::bf16) == "bf16");
  for (DType t : {DType::f32, DType::f64, DType::bf16}) {
    CHECK(is_floating(t));
    CHECK_FALSE(is_integral(t));
  }
  for (DType t : {DType::i32, DType::i64, DType::u16}) {
    CHECK(is_integral(t));
    CHECK_FALSE(is_floating(t));
  }
  CHECK(dtype_v<float> == DType::f32);
  CHECK(dtype_v<double> == DType::f64);
  CHECK(dtype_v<bf16> == DType::bf16);
  CHECK(dtype_v<int32_t> == DType::i32);
  CHECK(dtype_v<int64_t> == DType::i64);
  CHECK(dtype_v<uint16_t> == DType::u16);
}

TEST_CASE("dtype: bf16 keeps values that fit exactly", "[core][dtype][bf16]") {
  for (float f : {0.0f, 1.0f, -1.0f, 0.5f, 2.0f, 3.0f, -1.5f, 1.0078125f, 256.0f, 0.25f}) {
    bf16 b = bf16::from_float(f);
    CHECK(b.bits == static_cast<uint16_t>(bits_of(f) >> 16));
    CHECK(b.to_float() == f);
  }
  CHECK(bf16::from_float(-0.0f).bits == 0x8000);
  CHECK(bf16{0x3f80}.to_float() == 1.0f);
  CHECK(bf16{0xc000}.to_float() == -2.0f);
}

TEST_CASE("dtype: bf16 rounds to nearest, ties to even", "[core][dtype][bf16]") {
  // 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81): down.
  CHECK(bf16::from_float(float_from_bits(0x3f808000u)).bits == 0x3f80);
  // halfway between 0x3f81 (odd) and 0x3f82 (even): up.
  CHECK(bf16::from_float(float_from_bits(0x3f818000u)).bits == 0x3f82);
  // just above / below halfway.
  CHECK(bf16::from_float(float_from_bits(0x3f808001u)).bits == 0x3f81);
  CHECK(bf16::from_float(float_from_bits(0x3f807fffu)).bits == 0x3f80);
  CHECK(bf16::from_float(float_from_bits(0x3f817fffu)).bits == 0x3f81);
  // negative ties, same rule on the magnitude.
  CHECK(bf16::from_float(float_from_bits(0xbf808000u)).bits == 0xbf80);
  CHECK(bf16::from_float(float_from_bits(0xbf818000u)).bits == 0xbf82);
  // a carry into the exponent: 2 - 2^-8 (halfway, odd mantissa 0x7f) rounds up to 2.
  CHECK(bf16::from_float(float_from_bits(0x3fff8000u)).bits == 0x4000);
  CHECK(bf16::from_float(float_from_bits(0x3fff8000u)).to_float() == 2.0f);
  // subnormals round the same way.
  CHECK(bf16::from_float(float_from_bits(0x00008000u)).bits == 0x0000);
  CHECK(bf16::from_float(float_from_bits(0x00018000u)).bits == 0x0002);
  CHECK(bf16::from_float(float_from_bits(0x00008001u)).bits == 0x0001);
}

TEST_CASE("dtype: bf16 rounding matches a by-value reference on many floats", "[core][dtype][bf16]") {
  // The reference rounds by value: subnormal inputs must be read as themselves.
  const moetrain::testing::KeepDenormals keep;
  // Every low-16-bit pattern near the ties, over a spread of exponents and signs.
  std::vector<uint32_t> highs{0x0000u, 0x0001u, 0x007fu, 0x0080u, 0x3f80u, 0x3f81u, 0x3fffu, 0x4049u,
                              0x7f00u, 0x7f7eu, 0x8000u, 0x8001u, 0xbf80u, 0xc2c8u, 0xff7eu};
  std::vector<uint32_t> lows{0x0000u, 0x0001u, 0x3fffu, 0x7ffeu, 0x7fffu, 0x8000u, 0x8001u, 0xc000u, 0xffffu};
  for (uint32_t h : highs)
    for (uint32_t l : lows) {
      uint32_t u = (h << 16) | l;
      float f = float_from_bits(u);
      INFO("f32 bits 0x" << std::hex << u);
      REQUIRE(bf16::from_float(f).bits == bf16_ref(f));
    }
  // Pseudo-random floats over the whole finite range.
  Generator gen(77);
  for (uint64_t c = 0; c < 20000; ++c) {
    uint32_t u = gen.bits(c)[0];
    if ((u & 0x7f800000u) == 0x7f800000u) continue;  // inf and NaN: tested apart
    float f = float_from_bits(u);
    INFO("f32 bits 0x" << std::hex << u);
    REQUIRE(bf16::from_float(f).bits == bf16_ref(f));
  }
}

TEST_CASE("dtype: bf16 overflow goes to infinity, infinity stays infinity", "[core][dtype][bf16]") {
  float inf = std::numeric_limits<float>::infinity();
  CHECK(bf16::from_float(inf).bits == 0x7f80);
  CHECK(bf16::from_float(-inf).bits == 0xff80);
  CHECK(std::isinf(bf16::from_float(inf).to_float()));
  // The largest finite f32 is beyond the last bf16 (0x7f7f) by more than half a step.
  CHECK(bf16::from_float(std::numeric_limits<float>::max()).bits == 0x7f80);
  // Below that halfway point it stays at the largest finite bf16.
  CHECK(bf16::from_float(float_from_bits(0x7f7f7fffu)).bits == 0x7f7f);
}

TEST_CASE("dtype: bf16 NaN stays NaN, sign kept", "[core][dtype][bf16]") {
  // NaNs whose payload lives only in the low 16 bits would truncate to infinity.
  for (uint32_t u : {0x7f800001u, 0x7f80ffffu, 0x7fc00000u, 0x7fffffffu, 0x7f8fffffu, 0xff800001u, 0xffc00000u}) {
    float f = float_from_bits(u);
    REQUIRE(std::isnan(f));
    bf16 b = bf16::from_float(f);
    INFO("f32 bits 0x" << std::hex << u << " -> bf16 0x" << b.bits);
    CHECK(std::isnan(b.to_float()));
    CHECK((b.bits & 0x8000u) == ((u >> 16) & 0x8000u));
  }
}

TEST_CASE("dtype: Tensor::to(bf16) rounds every element; back to f32 is exact", "[core][dtype][bf16]") {
  std::vector<uint32_t> patterns{0x3f808000u, 0x3f818000u, 0x3f808001u, 0x40490fdbu /* pi */,
                                 0xc2c80123u, 0x7f7fffffu, 0x00018000u, 0x7fc00001u};
  std::vector<float> f(patterns.size());
  for (size_t i = 0; i < patterns.size(); ++i) f[i] = float_from_bits(patterns[i]);
  Tensor x = from_span<float>(f, {static_cast<int64_t>(f.size())});
  Tensor b = x.to(DType::bf16);
  REQUIRE(b.dtype() == DType::bf16);
  REQUIRE(b.shape() == x.shape());
  const bf16* pb = b.data<bf16>();
  for (size_t i = 0; i < f.size(); ++i) {
    INFO("element " << i);
    if (std::isnan(f[i])) CHECK(std::isnan(pb[i].to_float()));
    else CHECK(pb[i].bits == bf16_ref(f[i]));
  }
  Tensor back = b.to(DType::f32);
  const float* pf = back.data<float>();
  for (size_t i = 0; i < f.size(); ++i) {
    uint32_t want = static_cast<uint32_t>(pb[i].bits) << 16;
    if (std::isnan(f[i])) CHECK(std::isnan(pf[i]));
    else CHECK(bits_of(pf[i]) == want);
  }
}

TEST_CASE("dtype: conversions through Tensor::to between all dtypes", "[core][dtype]") {
  // Values every dtype holds exactly: small non-negative integers.
  std::vector<double> v{0, 1, 2, 3, 7, 100, 255, 256};
  std::vector<DType> all{DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::u16};
  for (DType from : all)
    for (DType to : all) {
      DYNAMIC_SECTION(dtype_name(from) << " -> " << dtype_name(to)) {
        Tensor x = from_vector(v, {2, 4}, from);
        Tensor y = x.to(to);
        CHECK(y.dtype() == to);
        CHECK(y.shape() == Shape{2, 4});
        CHECK(y.to_vector() == v);
        if (from == to) CHECK(y.same_storage(x));
        else CHECK_FALSE(y.same_storage(x));
      }
    }
}

TEST_CASE("dtype: float to integer truncates toward zero; f64 to f32 rounds", "[core][dtype]") {
  Tensor x = from_vector({2.9, -2.9, 0.5, -0.5, 1e6 + 0.75}, {5}, DType::f64);
  CHECK(x.to(DType::i32).to_vector() == std::vector<double>{2, -2, 0, 0, 1000000});
  CHECK(x.to(DType::i64).to_vector() == std::vector<double>{2, -2, 0, 0, 1000000});
  Tensor third = from_vector({1.0 / 3.0}, {1}, DType::f64);
  CHECK(third.to(DType::f32).data<float>()[0] == static_cast<float>(1.0 / 3.0));
  // bf16 -> integer goes through the bf16 value: 3.140625 -> 3.
  CHECK(from_vector({3.14159}, {1}, DType::bf16).to(DType::i64).to_vector()[0] == 3);
  // integer -> bf16 rounds: 257 is not representable (8 mantissa bits) and ties to even 256.
  CHECK(from_vector({257, 259}, {2}, DType::i32).to(DType::bf16).to_vector() == std::vector<double>{256, 260});
}

TEST_CASE("dtype: u16 tokens convert to i64 and back", "[core][dtype]") {
  std::vector<uint16_t> tokens{0, 1, 50256, 65535};
  Tensor t = from_span<uint16_t>(tokens, {4});
  Tensor i = t.to(DType::i64);
  const int64_t* pi = i.data<int64_t>();
  CHECK(pi[2] == 50256);
  CHECK(pi[3] == 65535);
  Tensor back = i.to(DType::u16);
  const uint16_t* pu = back.data<uint16_t>();
  for (size_t k = 0; k < tokens.size(); ++k) CHECK(pu[k] == tokens[k]);
}
