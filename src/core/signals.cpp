#include "core/signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

#include <fmt/format.h>

namespace moetrain::signals {

namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2};
constexpr int kForceAfter = 3;  // the third SIGTERM/SIGINT/SIGHUP outside a save

// Lock-free atomics: safe to touch from a handler and from every thread.
std::atomic<int> g_stop{0}, g_first{0}, g_term_count{0}, g_saving{0};
std::atomic<bool> g_installed{false};

bool is_term_class(int sig) { return sig == SIGTERM || sig == SIGINT || sig == SIGHUP; }

void say(const char* text) {
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

// Only async-signal-safe calls: atomics, write(2), sigaction, raise.
extern "C" void on_stop_signal(int sig) {
  const int kind = sig == SIGUSR1 ? static_cast<int>(Stop::save_and_exit) : static_cast<int>(Stop::preempted);
  int seen = g_stop.load();
  while (kind > seen && !g_stop.compare_exchange_weak(seen, kind)) {
  }
  int none = 0;
  const bool first = g_first.compare_exchange_strong(none, sig);
  if (is_term_class(sig) && g_term_count.fetch_add(1) + 1 >= kForceAfter && g_saving.load() == 0) {
    say("moetrain: third stop signal outside a checkpoint save: ending now, without a checkpoint\n");
    struct sigaction sa {};
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, nullptr);
    raise(sig);
    return;
  }
  if (!first) return;
  switch (sig) {
    case SIGUSR1: say("moetrain: SIGUSR1: stopping at the next step boundary, with a checkpoint\n"); break;
    case SIGUSR2: say("moetrain: SIGUSR2: stopping at the next step boundary, with a checkpoint\n"); break;
    case SIGTERM: say("moetrain: SIGTERM: stopping at the next step boundary, with a checkpoint (a third "
                      "SIGTERM/SIGINT/SIGHUP ends the process at once)\n"); break;
    case SIGINT: say("moetrain: SIGINT: stopping at the next step boundary, with a checkpoint (a third "
                     "SIGTERM/SIGINT/SIGHUP ends the process at once)\n"); break;
    default: say("moetrain: SIGHUP: stopping at the next step boundary, with a checkpoint (a third "
                 "SIGTERM/SIGINT/SIGHUP ends the process at once)\n"); break;
  }
}

}  // namespace

void install() {
  if (g_installed.exchange(true)) return;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // reads and writes in flight go on instead of failing with EINTR
  for (int sig : kSignals) sigaction(sig, &sa, nullptr);
}

void restore_default_actions() {
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  for (int sig : kSignals) sigaction(sig, &sa, nullptr);
  g_installed = false;
  if (const int sig = g_first.load()) raise(sig);
}

Stop requested() { return static_cast<Stop>(g_stop.load()); }

int first_signal() { return g_first.load(); }

std::string name(int signal) {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    default: return fmt::format("signal {}", signal);
  }
}

int exit_code(Stop stop) { return stop == Stop::preempted ? kExitPreempted : 0; }

void throw_if_requested(const std::string& doing) {
  const Stop stop = requested();
  if (stop == Stop::none) return;
  throw Interrupted(fmt::format("interrupted by {} {}; nothing was written{} (exit code {})", name(first_signal()),
                                doing, stop == Stop::preempted ? "; run the same command again to train" : "",
                                exit_code(stop)),
                    exit_code(stop));
}

SaveGuard::SaveGuard() { ++g_saving; }
SaveGuard::~SaveGuard() { --g_saving; }

void reset_for_testing() {
  g_stop = 0;
  g_first = 0;
  g_term_count = 0;
}

}  // namespace moetrain::signals
