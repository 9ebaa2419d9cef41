#include "core/profile.h"

#include <algorithm>

#include <chrono>

#include <fmt/format.h>

namespace moetrain::profile {

namespace {
using Clock = std::chrono::steady_clock;

bool g_enabled = false;
const char* g_current = "other";
Clock::time_point g_since;  // when the current region last resumed (profiling on)
std::vector<Entry> g_entries;
double g_nodes_s = 0;  // Σ of add_backward

Entry& entry(const char* region) {
  for (Entry& e : g_entries)
    if (e.region == region) return e;
  g_entries.push_back({region, 0, 0});
  return g_entries.back();
}

// Charges the time since the last switch to the current region.
void charge(Clock::time_point now) {
  entry(g_current).forward_s += std::chrono::duration<double>(now - g_since).count();
  g_since = now;
}
}  // namespace

void set_enabled(bool on) {
  g_enabled = on;
  g_since = Clock::now();
}
bool enabled() { return g_enabled; }
const char* current_region() { return g_current; }

Region::Region(const char* name) : saved_(g_current), timed_(g_enabled) {
  if (timed_) charge(Clock::now());
  g_current = name;
}

Region::~Region() {
  if (timed_ && g_enabled) charge(Clock::now());
  g_current = saved_;
}

BackwardPass::BackwardPass() : timed_(g_enabled), nodes_s_at_start_(g_nodes_s) {
  if (timed_) charge(Clock::now());
}

BackwardPass::~BackwardPass() {
  if (!timed_ || !g_enabled) return;
  Clock::time_point now = Clock::now();
  double pass = std::chrono::duration<double>(now - g_since).count();
  entry("autograd").backward_s += pass - (g_nodes_s - nodes_s_at_start_);
  g_since = now;
}

void add_backward(const char* region, double seconds) {
  entry(region).backward_s += seconds;
  g_nodes_s += seconds;
}

std::vector<Entry> entries() { return g_entries; }
void reset() {
  g_entries.clear();
  g_since = Clock::now();
}

std::string format_table(const std::vector<Entry>& entries, int64_t steps) {
  const double per = 1e3 / static_cast<double>(std::max<int64_t>(steps, 1));  // s -> ms per step
  double total = 0;
  for (const Entry& e : entries) total += e.forward_s + e.backward_s;
  std::string out = fmt::format("  {:<16} {:>9} {:>9} {:>9} {:>6}", "component", "forward", "backward", "ms/step",
                                "share");
  for (const Entry& e : entries)
    out += fmt::format("\n  {:<16} {:>9.1f} {:>9.1f} {:>9.1f} {:>5.1f}%", e.region, e.forward_s * per,
                       e.backward_s * per, (e.forward_s + e.backward_s) * per,
                       total > 0 ? 100 * (e.forward_s + e.backward_s) / total : 0.0);
  out += fmt::format("\n  {:<16} {:>9} {:>9} {:>9.1f}", "total", "", "", total * per);
  return out;
}

}  // namespace moetrain::profile
