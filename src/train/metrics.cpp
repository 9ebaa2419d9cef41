#include "train/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "io/durable.h"
#include "io/paths.h"

namespace moetrain {

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The "step" of a record line, or -1 (no step, or not JSON).
int64_t step_of(const std::string& line) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) return -1;
  return j["step"].get<int64_t>();
}

constexpr const char* kWhat = "the metrics file (JSON lines)";

// The whole file; a directory, FIFO or device at its path is refused (Error naming it, exit 2), never read.
std::string read_all(const std::string& path) { return read_regular_file(path, kWhat); }

// Opens `path` for appending (created if missing) and returns the descriptor. A
// directory, FIFO or device there is refused (Error naming it, exit 2): O_NONBLOCK
// keeps the open of a FIFO from waiting for a reader.
int open_for_appending(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == EISDIR || err == ENXIO) require_regular_file(path, kWhat);  // a directory, a FIFO: Error naming it
    throw IoError(fmt::format("{}: cannot open for appending: {}", path, std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("{}: not a regular file ({}); expected {}", path, file_kind_name(st.st_mode), kWhat));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

// One write(2) of the whole text at the end of fd; a short write is cut back off.
void append_whole(int fd, const std::string& text, const std::string& path) {
  struct stat st {};
  const off_t before = ::fstat(fd, &st) == 0 ? st.st_size : -1;
  const ssize_t n = ::write(fd, text.data(), text.size());
  if (n == static_cast<ssize_t>(text.size())) return;
  const int err = n < 0 ? errno : ENOSPC;  // a short write: the disk filled up
  if (n > 0 && before >= 0 && ::ftruncate(fd, before) != 0)
    throw IoError(fmt::format("{}: writing a record failed ({}) and cutting off its part failed too ({})", path,
                              std::strerror(err), std::strerror(errno)));
  throw IoError(fmt::format("{}: writing a record failed: {} (the file ends with the last complete record)", path,
                            std::strerror(err)));
}

}  // namespace

MetricsRepair repair_metrics(const std::string& path, int64_t step, const std::string& aside_path) {
  MetricsRepair r;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return r;
  const std::string text = read_all(path);
  std::string kept, dropped;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    if (end == std::string::npos) {  // no newline: the write of this line did not finish
      r.torn_line = true;
      break;
    }
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    const int64_t s = step_of(line);
    if (s > step) {
      ++r.dropped;
      dropped += line + "\n";
      continue;
    }
    if (s >= 0) ++r.records;
    kept += line + "\n";
  }
  if (r.torn_line)
    spdlog::warn("{}: dropped an incomplete last line ({} bytes, a write cut short by a crash)", path,
                 text.size() - begin);
  if (r.dropped == 0 && !r.torn_line) return r;
  if (!dropped.empty() && !aside_path.empty()) {
    const int fd = open_for_appending(aside_path);
    try {
      append_whole(fd, dropped, aside_path);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }
  write_file_atomically(path, kept);
  return r;
}

int64_t count_metrics_records(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return 0;
  std::istringstream in(read_all(path));
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += step_of(line) >= 0;
  return n;
}

MetricsWriter::MetricsWriter(const std::string& path, std::string run_id)
    : path_(path), run_id_(std::move(run_id)), fd_(open_for_appending(path)) {}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

std::string MetricsWriter::to_json(const std::vector<std::pair<std::string, Value>>& fields) {
  std::string line = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) line += ",";
    line += json_string(fields[i].first) + ":";
    const Value& v = fields[i].second;
    if (auto* n = std::get_if<int64_t>(&v)) line += std::to_string(*n);
    else if (auto* d = std::get_if<double>(&v)) line += std::isfinite(*d) ? fmt::format("{:.9g}", *d) : "null";
    else if (auto* s = std::get_if<std::string>(&v)) line += json_string(*s);
    else line += std::get<bool>(v) ? "true" : "false";
  }
  return line + "}";
}

void MetricsWriter::write(std::vector<std::pair<std::string, Value>> fields) {
  if (!run_id_.empty()) fields.emplace_back("run", run_id_);
  append_whole(fd_, to_json(fields) + "\n", path_);
}

}  // namespace moetrain
