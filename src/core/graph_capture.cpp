#include "core/graph_capture.h"

#include <utility>

namespace moetrain::graph {

namespace {
// The hooks of this thread's capture; null when it captures nothing.
thread_local ReplayHooks* t_capture = nullptr;
}  // namespace

bool capturing() { return t_capture != nullptr; }

void refuse_if_capturing(const char* what) {
  if (t_capture)
    throw CaptureRefused(fmt::format("{} while the step is captured into a CUDA graph: a replay would not repeat it",
                                     what));
}

void before_replay(std::function<void()> fn) {
  if (t_capture) t_capture->before.push_back(std::move(fn));
}

void after_replay(std::function<void()> fn) {
  if (t_capture) t_capture->after.push_back(std::move(fn));
}

void keep(std::shared_ptr<const void> owner) {
  if (t_capture) t_capture->kept.push_back(std::move(owner));
}

CaptureScope::CaptureScope() {
  MT_ASSERT(!t_capture, "a CUDA graph capture inside another");
  t_capture = new ReplayHooks;
}

CaptureScope::~CaptureScope() {
  delete t_capture;
  t_capture = nullptr;
}

ReplayHooks CaptureScope::take() {
  ReplayHooks out = std::move(*t_capture);
  *t_capture = ReplayHooks{};
  return out;
}

}  // namespace moetrain::graph
