// Where a tensor's storage lives. The CPU is always there; CUDA devices exist
// when the CUDA backend is built and a GPU is present (src/backend/cuda/).
#pragma once

#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace moetrain {

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }
};

inline constexpr Device kCpu{DeviceKind::cpu, 0};
inline constexpr Device kCuda{DeviceKind::cuda, 0};

}  // namespace moetrain

template <>
struct fmt::formatter<moetrain::Device> : fmt::formatter<std::string> {
  auto format(const moetrain::Device& d, format_context& ctx) const {
    return fmt::formatter<std::string>::format(d.str(), ctx);
  }
};
