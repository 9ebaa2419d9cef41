// Test helpers for the config tests: a temporary directory that removes itself,
// and the message of the ConfigError an expression throws.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

#include "config/config.h"

namespace moetrain::testing {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("moetrain-config-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string path() const { return path_.string(); }
  // Writes `text` to `name` (creating subdirectories) and returns the full path.
  std::string write(const std::string& name, const std::string& text) const {
    std::filesystem::path p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

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
