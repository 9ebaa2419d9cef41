#include "train/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/durable.h"

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

int64_t truncate_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return 0;
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<int64_t>() > step) {
      ++dropped;
      continue;
    }
    kept += line + "\n";
  }
  in.close();
  if (dropped == 0) return 0;
  write_file_atomically(path, kept);
  return dropped;
}

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
