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
// the CLI exits with code 3 instead of 2 (bad input).
class NumericalError : public Error {
 public:
  explicit NumericalError(const std::string& what) : Error(what) {}
};

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
