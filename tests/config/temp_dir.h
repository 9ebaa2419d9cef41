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
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("expected a ConfigError, got another exception: " << e.what());
    return "";
  }
  FAIL_CHECK("expected a ConfigError, nothing was thrown");
  return "";
}

}  // namespace moetrain::testing
