// Progress (format and policy in progress.h).
#include "data/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

namespace moetrain::data {

namespace {
double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Display width of UTF-8 text: code points, counting the block characters as one column.
size_t columns(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}
}  // namespace

Progress::Progress(std::string desc, int64_t total, ProgressOptions options)
    : desc_(std::move(desc)), total_(total), options_(std::move(options)) {
  if (!options_.clock) options_.clock = steady_seconds;
  if (options_.mode == ProgressOptions::Mode::automatic)
    bar_ = options_.out != nullptr && ::isatty(::fileno(options_.out));
  else
    bar_ = options_.mode == ProgressOptions::Mode::bar;
  if (options_.mode == ProgressOptions::Mode::off || options_.out == nullptr) finished_ = true;  // never draws
  start_ = last_draw_ = options_.clock();
  next_line_count_ = total_ > 0 ? static_cast<int64_t>(std::ceil(total_ * options_.line_fraction)) : 0;
  if (bar_ && !finished_ && options_.delay_s <= 0) draw(false);
}

Progress::~Progress() { finish(); }

double Progress::elapsed_s() const { return options_.clock() - start_; }

void Progress::set_postfix(std::string postfix) { postfix_ = std::move(postfix); }

void Progress::update(int64_t n) {
  count_ += n;
  if (finished_) return;
  const double now = options_.clock();
  if (!drawn_ && now - start_ < options_.delay_s) return;
  if (bar_) {
    if (now - last_draw_ >= options_.bar_interval_s) draw(false);
    return;
  }
  const bool fraction_due = total_ > 0 && count_ >= next_line_count_ && count_ < total_;
  if (fraction_due || now - last_draw_ >= options_.line_interval_s) draw(false);
}

void Progress::finish() {
  if (finished_) return;
  if (drawn_ || options_.clock() - start_ >= options_.delay_s) draw(true);
  finished_ = true;
}

void Progress::draw(bool final) {
  drawn_ = true;
  last_draw_ = options_.clock();
  std::string text = format(bar_);
  if (bar_) {
    const size_t width = columns(text);
    std::string line = "\r" + text;
    if (width < last_width_) line.append(last_width_ - width, ' ');  // blank what the last draw left
    last_width_ = width;
    if (final) line += '\n';
    std::fputs(line.c_str(), options_.out);
  } else {
    std::fputs((text + "\n").c_str(), options_.out);
    if (total_ > 0) {
      const auto step = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(total_ * options_.line_fraction)));
      while (next_line_count_ <= count_) next_line_count_ += step;
    }
  }
  std::fflush(options_.out);
}

std::string Progress::format_count(double value, bool scale) {
  if (!scale || std::abs(value) < 1000) {
    if (value == std::floor(value)) return fmt::format("{}", static_cast<int64_t>(value));
    return fmt::format("{:.3g}", value);
  }
  static constexpr const char* kPrefixes[] = {"k", "M", "G", "T", "P", "E"};
  int p = -1;
  while (std::abs(value) >= 999.5 && p < 5) {
    value /= 1000;
    ++p;
  }
  if (std::abs(value) >= 99.95) return fmt::format("{:.0f}{}", value, kPrefixes[p]);
  if (std::abs(value) >= 9.995) return fmt::format("{:.1f}{}", value, kPrefixes[p]);
  return fmt::format("{:.2f}{}", value, kPrefixes[p]);
}

std::string Progress::format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{:02}:{:02}", s / 60, s % 60);
}

std::string Progress::format(bool with_bar) const {
  const double elapsed = elapsed_s();
  const double rate = elapsed > 0 ? static_cast<double>(count_) / elapsed : 0.0;
  const bool scale = options_.scale;
  std::string rate_text;
  if (elapsed <= 0 || count_ == 0) rate_text = fmt::format("?{}/s", options_.unit);
  else if (scale && rate >= 999.5) rate_text = fmt::format("{}{}/s", format_count(rate, true), options_.unit);
  else rate_text = fmt::format("{:.2f}{}/s", rate, options_.unit);
  std::string tail;
  if (total_ > 0) {
    const std::string eta =
        rate > 0 ? format_duration(static_cast<double>(std::max<int64_t>(0, total_ - count_)) / rate) : "?";
    tail = fmt::format("{}/{} [{}<{}, {}", format_count(static_cast<double>(count_), scale),
                       format_count(static_cast<double>(total_), scale), format_duration(elapsed), eta, rate_text);
  } else {
    tail = fmt::format("{}{} [{}, {}", format_count(static_cast<double>(count_), scale), options_.unit,
                       format_duration(elapsed), rate_text);
  }
  if (!postfix_.empty()) tail += ", " + postfix_;
  tail += "]";
  std::string head = desc_.empty() ? "" : desc_ + ": ";
  if (total_ <= 0) return head + tail;

  const double frac = std::clamp(static_cast<double>(count_) / static_cast<double>(total_), 0.0, 1.0);
  const int64_t whole_percent = count_ >= total_ ? 100 : std::max<int64_t>(0, count_) * 100 / total_;  // rounds down
  const std::string percent = fmt::format("{:3}%", whole_percent);
  if (!with_bar) return head + percent + " " + tail;

  int width = options_.width;
  if (width <= 0) {
    struct winsize ws {};
    width = ::ioctl(::fileno(options_.out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 ? ws.ws_col : 80;
  }
  const int fixed = static_cast<int>(columns(head) + percent.size() + 2 + 1 + columns(tail));  // "|", "|", " "
  const int bar_width = std::max(10, width - fixed - 1);
  // Eighths of a cell, as tqdm: full blocks, then one partial block.
  static constexpr const char* kPartial[] = {"", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
  const auto eighths = static_cast<int64_t>(frac * bar_width * 8);
  const int64_t full = eighths / 8;
  std::string bar;
  for (int64_t i = 0; i < full; ++i) bar += "█";
  int64_t used = full;
  if (full < bar_width && eighths % 8) {
    bar += kPartial[eighths % 8];
    ++used;
  }
  bar.append(static_cast<size_t>(bar_width - used), ' ');
  return head + percent + "|" + bar + "| " + tail;
}

}  // namespace moetrain::data
