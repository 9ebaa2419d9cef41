#include "core/profile.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

namespace moetrain::profile {

namespace {
using Clock = std::chrono::steady_clock;

// What the time since the last switch is charged to: a region's forward or its
// backward. Regions, node scopes and backward passes switch it and restore the
// one they found, so time is exclusive of what is nested.
struct Target {
  const char* region = "other";
  bool backward = false;
};

bool g_enabled = false;
const char* g_current = "other";  // the innermost Region (nodes record it)
Target g_target;
std::vector<Entry> g_entries;

// Host clock: when the current target last started.
Clock::time_point g_since;

// Device clock: marks[i] .. marks[i + 1] is charged to targets[i]; the last mark
// opens the interval of the current target.
DeviceClock* g_clock = nullptr;
std::vector<int64_t> g_marks;
std::vector<Target> g_mark_targets;
constexpr size_t kMarksBeforeReading = 4096;

Entry& entry(const char* region) {
  for (Entry& e : g_entries)
    if (e.region == region) return e;
  g_entries.push_back({region, 0, 0});
  return g_entries.back();
}

void add(Target t, double seconds) {
  Entry& e = entry(t.region);
  (t.backward ? e.backward_s : e.forward_s) += seconds;
}

// Charges the device intervals recorded so far; the last mark stays open.
void read_marks() {
  if (g_marks.size() < 2) return;
  const std::vector<double> s = g_clock->intervals(g_marks);
  for (size_t i = 0; i < s.size() && i < g_mark_targets.size(); ++i) add(g_mark_targets[i], s[i]);
  g_marks.erase(g_marks.begin(), g_marks.end() - 1);
  g_mark_targets.clear();
}

// Closes the current target's interval (profiling on) and opens `next`'s.
void switch_to(Target next) {
  if (g_enabled) {
    if (g_clock) {
      g_mark_targets.push_back(g_target);
      g_marks.push_back(g_clock->mark());
      if (g_marks.size() >= kMarksBeforeReading) read_marks();
    } else {
      const Clock::time_point now = Clock::now();
      add(g_target, std::chrono::duration<double>(now - g_since).count());
      g_since = now;
    }
  }
  g_target = next;
}
}  // namespace

void set_enabled(bool on) {
  if (on == g_enabled) return;
  if (on) {
    g_enabled = true;
    g_since = Clock::now();
    if (g_clock) {
      g_marks.assign(1, g_clock->mark());
      g_mark_targets.clear();
    }
    return;
  }
  switch_to(g_target);  // the time up to now is charged
  if (g_clock) {
    read_marks();
    for (int64_t m : g_marks) g_clock->release(m);
    g_marks.clear();
  }
  g_enabled = false;
}
bool enabled() { return g_enabled; }
const char* current_region() { return g_current; }

void set_device_clock(DeviceClock* clock) {
  if (g_enabled) set_enabled(false);
  g_clock = clock;
}
DeviceClock* device_clock() { return g_clock; }

Region::Region(const char* name)
    : saved_(g_current), saved_target_(g_target.region), saved_backward_(g_target.backward) {
  g_current = name;
  switch_to({name, false});
}

Region::~Region() {
  switch_to({saved_target_, saved_backward_});
  g_current = saved_;
}

BackwardScope::BackwardScope(const char* region)
    : saved_region_(g_target.region), saved_backward_(g_target.backward) {
  switch_to({region, true});
}

BackwardScope::~BackwardScope() { switch_to({saved_region_, saved_backward_}); }

std::vector<Entry> entries() {
  if (g_enabled && g_clock) {
    switch_to(g_target);
    read_marks();
  }
  return g_entries;
}

void reset() {
  g_entries.clear();
  g_since = Clock::now();
  if (g_enabled && g_clock) {
    switch_to(g_target);
    read_marks();
    g_entries.clear();
  }
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
