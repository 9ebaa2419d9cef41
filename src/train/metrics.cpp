#include "train/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"

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
}  // namespace

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "a");
  MT_CHECK(file_ != nullptr, "{}: cannot open the metrics file for appending: {}", path, std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
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

void MetricsWriter::write(const std::vector<std::pair<std::string, Value>>& fields) {
  std::string line = to_json(fields) + "\n";
  MT_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
           "{}: writing metrics failed: {}", path_, std::strerror(errno));
}

}  // namespace moetrain
