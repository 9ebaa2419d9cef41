// Element types. f32 and f64 are compute types (f64 for gradient checks and
// reference paths); bf16 is a storage type (converted to f32 to compute on the
// CPU); i32, i64 and u16 hold indices and tokens (u16: llm.c token shards).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#include <fmt/format.h>

namespace moetrain {

enum class DType : uint8_t { f32, f64, bf16, i32, i64, u16 };

inline constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u16: return 2;
  }
  return 0;
}

inline constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u16: return "u16";
  }
  return "?";
}

inline constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16;
}
inline constexpr bool is_integral(DType t) { return !is_floating(t); }

// bfloat16: the upper 16 bits of an IEEE f32. Conversion rounds to nearest even;
// NaN stays NaN (quiet bit forced so rounding cannot turn it into infinity).
struct bf16 {
  uint16_t bits = 0;

  static bf16 from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bf16 r;
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      r.bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
      return r;
    }
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    r.bits = static_cast<uint16_t>((u + rounding) >> 16);
    return r;
  }
  float to_float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<uint16_t> { static constexpr DType value = DType::u16; };
template <class T> inline constexpr DType dtype_v = dtype_of<T>::value;

}  // namespace moetrain

template <>
struct fmt::formatter<moetrain::DType> : fmt::formatter<std::string_view> {
  auto format(moetrain::DType t, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(moetrain::dtype_name(t), ctx);
  }
};
