// Human-readable numbers for reports and logs.
#pragma once

#include <cstdint>
#include <string>

namespace moetrain {

// 1234567 -> "1,234,567".
std::string with_commas(int64_t n);
// 1536 -> "1.5 KiB" (B, KiB, ..., PiB).
std::string human_bytes(double bytes);

}  // namespace moetrain
