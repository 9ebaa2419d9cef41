// Helpers for the [data] tests: paths to the source tree and build, and the
// reference GPT-2 tokenizer (tests/reference/gpt2_tokenizer.py); the general
// ones (TempDir, file I/O, commands) come from tests/testing.h.
#pragma once

#include "testing.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain::data_testing {

inline const std::string kSourceDir = MOETRAIN_SOURCE_DIR;
inline const std::string kBinaryDir = MOETRAIN_BINARY_DIR;
inline const std::string kGpt2Dir = kSourceDir + "/data/gpt2";
inline const std::string kShakespeare = kSourceDir + "/data/tinyshakespeare.txt";

using moetrain::testing::read_bytes;
using moetrain::testing::run_command;
using moetrain::testing::shell_quote;
using moetrain::testing::TempDir;
using moetrain::testing::write_bytes;

// Token ids of `input` by tests/reference/gpt2_tokenizer.py (OpenAI's encoder.py),
// run with /usr/bin/python3; errors = "strict" or "replace" (Python's UTF-8 decoding).
inline std::vector<int32_t> reference_gpt2_ids(const std::string& input, const std::string& errors = "strict") {
  TempDir dir;
  const std::string out = dir / "ids.txt";
  const std::string cmd = "/usr/bin/python3 " + shell_quote(kSourceDir + "/tests/reference/gpt2_tokenizer.py") + " " +
                          shell_quote(kGpt2Dir) + " " + shell_quote(input) + " " + shell_quote(out) + " --errors " +
                          errors;
  if (int rc = run_command(cmd); rc != 0)
    throw std::runtime_error("reference tokenizer failed (exit " + std::to_string(rc) + "): " + cmd);
  std::istringstream in(read_bytes(out));
  std::vector<int32_t> ids;
  for (int32_t id; in >> id;) ids.push_back(id);
  return ids;
}

// The pre-tokenizer pieces of `input` by the same script (Python regex findall).
inline std::vector<std::string> reference_gpt2_pieces(const std::string& input) {
  TempDir dir;
  const std::string out = dir / "pieces.txt";
  const std::string cmd = "/usr/bin/python3 " + shell_quote(kSourceDir + "/tests/reference/gpt2_tokenizer.py") + " " +
                          shell_quote(kGpt2Dir) + " " + shell_quote(input) + " " + shell_quote(out) + " --pieces";
  if (int rc = run_command(cmd); rc != 0)
    throw std::runtime_error("reference tokenizer failed (exit " + std::to_string(rc) + "): " + cmd);
  std::istringstream in(read_bytes(out));
  std::vector<std::string> pieces;
  for (std::string hex; in >> hex;) {
    std::string piece;
    for (size_t i = 0; i + 1 < hex.size(); i += 2)
      piece.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    pieces.push_back(piece);
  }
  return pieces;
}

}  // namespace moetrain::data_testing
