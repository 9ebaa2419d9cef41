// <run>/metrics.jsonl: one JSON object per line, the run's whole history. Floats
// are printed with %.9g so f32 values round-trip exactly. Each line is appended
// with one write(2) of the complete line; a write that fails (disk full) is cut
// back off, so the file never holds part of a line from a running process. A line
// torn by a crash (no newline at the end of the file) is dropped by the next
// start (repair_metrics).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace moetrain {

// What repair_metrics did.
struct MetricsRepair {
  int64_t records = 0;       // records kept
  int64_t dropped = 0;       // records after `step`, dropped (or moved to aside_path)
  bool torn_line = false;    // an incomplete last line was dropped
};

// A run that starts at `step` (0: from scratch, else the checkpoint it resumed
// from) makes the file one history: the records of steps after `step` (written by
// a run that stopped after its last checkpoint, or by an abandoned branch) are
// dropped, appended to `aside_path` when it is not empty; an incomplete last line
// is dropped. Records are kept or dropped by their "step" field; complete lines
// that do not parse are kept. The file is rewritten atomically when something
// changes; nothing happens when it does not exist. Throws IoError when writing
// fails.
MetricsRepair repair_metrics(const std::string& path, int64_t step, const std::string& aside_path = "");

// Records of the file (lines with a "step"), 0 when it does not exist.
int64_t count_metrics_records(const std::string& path);

class MetricsWriter {
 public:
  using Value = std::variant<int64_t, double, std::string, bool>;
  // Appends (a resumed run continues the file). A non-empty run_id is written as
  // the last field of every record ("run"). Throws IoError when it cannot be opened.
  explicit MetricsWriter(const std::string& path, std::string run_id = "");
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Throws IoError (exit 5) naming the file when the line cannot be written whole.
  void write(std::vector<std::pair<std::string, Value>> fields);
  static std::string to_json(const std::vector<std::pair<std::string, Value>>& fields);

 private:
  std::string path_, run_id_;
  int fd_ = -1;
};

}  // namespace moetrain
