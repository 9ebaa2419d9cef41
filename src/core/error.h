// Errors. User errors (bad shapes, dtypes, indices, configs, files) throw
// moetrain::Error with a message that says what was expected, what was found and
// where; the CLI logs it once and exits non-zero. MT_ASSERT guards our own
// invariants and names the source line, because a failure there is our bug.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace moetrain {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A numerical failure of a run (non-finite loss or gradients past the policy):
// exit code 3.
class NumericalError : public Error {
 public:
  explicit NumericalError(const std::string& what) : Error(what) {}
};

// Memory ran out (a host allocation failed): exit code 4.
class OutOfMemoryError : public Error {
 public:
  explicit OutOfMemoryError(const std::string& what) : Error(what) {}
};

// Reading or writing a file failed for a reason outside the input's content
// (disk full, permission, fsync or rename failed): exit code 5. A file whose
// content is wrong (corrupt, truncated, mismatched) is bad input: Error, exit 2.
class IoError : public Error {
 public:
  explicit IoError(const std::string& what) : Error(what) {}
};

// Exit codes of the command line, by class of failure (docs/training.md).
inline constexpr int kExitBadInput = 2, kExitNumerical = 3, kExitOutOfMemory = 4, kExitIo = 5,
                     kExitWatchdog = 42;

namespace detail {
[[noreturn]] void throw_assert(const char* cond, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace moetrain

// MT_CHECK(cond, "fmt {}", args...): throws moetrain::Error with the formatted message.
#define MT_CHECK(cond, ...)                                          \
  do {                                                               \
    if (!(cond)) [[unlikely]]                                        \
      throw ::moetrain::Error(::fmt::format(__VA_ARGS__));           \
  } while (0)

#define MT_THROW(...) throw ::moetrain::Error(::fmt::format(__VA_ARGS__))

// MT_ASSERT(cond, "fmt {}", args...): an internal invariant; names file:line.
#define MT_ASSERT(cond, ...)                                                          \
  do {                                                                                \
    if (!(cond)) [[unlikely]]                                                         \
      ::moetrain::detail::throw_assert(#cond, __FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
  } while (0)
