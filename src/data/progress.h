// Progress: a tqdm-style progress report for long loops (tokenizing, later
// checkpoint save/load, export), written by hand as Debian 12 packages no C++ one.
//
// On a terminal (isatty) it redraws one line with '\r', at most every 0.1 s:
//   prepare: 42%|██████████▌              | 420M/1.00G [00:12<00:17, 34.1MB/s, 88.2M tok]
// Elsewhere (CI logs, Slurm output) it writes a plain line each time another
// 10% is done or 10 s have passed, whichever comes first, and a last one at the end:
//   prepare: 42% 420M/1.00G [00:12<00:17, 34.1MB/s, 88.2M tok]
// Counts and rates use SI prefixes (k, M, G, T; divisor 1000) when `scale` is
// set. Only one process should report: pass Mode::off on the other ranks.
// Not thread-safe: one thread updates a Progress.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

namespace moetrain::data {

struct ProgressOptions {
  enum class Mode { automatic, bar, lines, off };
  Mode mode = Mode::automatic;     // automatic: bar when `out` is a terminal, else lines
  std::string unit = "it";         // after counts and in rates: "it/s", "B/s", "tok/s"
  bool scale = false;              // SI prefixes on counts and rates
  std::FILE* out = stderr;
  double bar_interval_s = 0.1;     // bar: the least time between redraws
  double line_interval_s = 10.0;   // lines: the most time between lines
  double line_fraction = 0.1;      // lines: a line each time this fraction of the total is passed
  int width = 0;                   // bar: line width in columns; 0 = the terminal's, else 80
  double delay_s = 0;              // nothing is drawn (not even the end) unless this much time passes first
  std::function<double()> clock;   // seconds on a monotonic clock; default std::chrono::steady_clock

  // Bytes with SI prefixes (B, kB/s ...), drawn automatically when `report`, else off.
  static ProgressOptions bytes(bool report, double delay_s = 0) {
    ProgressOptions o;
    o.mode = report ? Mode::automatic : Mode::off;
    o.unit = std::string("B");  // not = "B": GCC 12 -Wrestrict false positive (PR 105329)
    o.scale = true;
    o.delay_s = delay_s;
    return o;
  }
};

class Progress {
 public:
  // total <= 0: unknown (no percentage, bar or ETA).
  Progress(std::string desc, int64_t total, ProgressOptions options = {});
  ~Progress();  // finish()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void update(int64_t n = 1);                // adds n to the count
  void set_postfix(std::string postfix);     // shown after the rate, e.g. "88.2M tok"
  // Draws the final state (and ends the bar's line). Idempotent.
  void finish();

  int64_t count() const { return count_; }
  double elapsed_s() const;
  // The report as text without a trailing newline: with the bar (terminal
  // form) or without (log form).
  std::string format(bool with_bar) const;

  // "1.23M", "456", "12.3k" (SI, three significant digits) and "01:05" / "1:02:03".
  static std::string format_count(double value, bool scale);
  static std::string format_duration(double seconds);

 private:
  void draw(bool final);

  std::string desc_;
  int64_t total_;
  ProgressOptions options_;
  bool bar_ = false;  // resolved mode: bar or lines
  bool finished_ = false;
  bool drawn_ = false;  // something was drawn (delay_s passed)
  int64_t count_ = 0;
  std::string postfix_;
  double start_ = 0, last_draw_ = 0;
  int64_t next_line_count_ = 0;  // lines mode: the count at which the next 10% line is due
  size_t last_width_ = 0;        // bar mode: characters drawn last time (to blank leftovers)
};

}  // namespace moetrain::data
