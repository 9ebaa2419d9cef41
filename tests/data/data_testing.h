// Helpers for the [data] tests (namespace data_testing: tests/config has its own
// testing::TempDir, and one name with two definitions would break the ODR): a
// temporary directory, whole-file I/O, running a command, and paths to the
// source tree and build.
#pragma once

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

// A fresh directory under $TMPDIR (or /tmp), removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/moetrain_test_XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return std::move(ss).str();
}

inline void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// Runs `command` with /bin/sh; returns its exit status (or -1 if it did not exit normally).
inline int run_command(const std::string& command) {
  int status = std::system(command.c_str());
  return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Single-quotes a string for /bin/sh.
inline std::string shell_quote(std::string_view s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

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
