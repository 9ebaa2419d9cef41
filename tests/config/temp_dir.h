// Test helper for the config tests: the message of the ConfigError an expression
// throws (TempDir comes from tests/testing.h).
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

#include "config/config.h"
#include "testing.h"

namespace moetrain::testing {

using TempDir = moetrain::testing::TempDir;

// The what() of the ConfigError that f() throws; fails the test otherwise.
template <class F>
std::string config_error(F&& f) {
  return error_of<ConfigError>(std::forward<F>(f));
}

}  // namespace moetrain::testing
