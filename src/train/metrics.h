// <run>/metrics.jsonl: one JSON object per line, appended and flushed per
// record. Floats are printed with %.9g so f32 values round-trip exactly.
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace moetrain {

// A resumed run: drops the records of steps after `step` (written by the run that
// stopped after its last checkpoint), so the file reads as one history. Records
// are kept or dropped by their "step" field; lines that do not parse are kept.
// Rewritten atomically; nothing happens when the file does not exist. Returns
// the number of records dropped.
int64_t truncate_metrics_after(const std::string& path, int64_t step);

class MetricsWriter {
 public:
  using Value = std::variant<int64_t, double, std::string, bool>;
  explicit MetricsWriter(const std::string& path);  // appends (a resumed run continues the file)
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const std::vector<std::pair<std::string, Value>>& fields);
  static std::string to_json(const std::vector<std::pair<std::string, Value>>& fields);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace moetrain
