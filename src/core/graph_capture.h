// What code must know while a training step is captured into a CUDA graph
// (docs/cuda.md, "CUDA graphs"). A replay runs the captured kernels again, on the
// same device memory, and none of the host code that queued them: a copy from a
// host buffer, a host-made plan, a random offset drawn on the host or a host handle
// set by the forward would be stale on every replay, and the step would train wrong
// without an error. So, while this thread captures:
//  - host work a replay would not repeat refuses (refuse_if_capturing): the copies
//    to and from the host, waits for the device, random draws. The capture is
//    abandoned and the step runs eagerly (train.cuda_graph: auto) or the run stops
//    (on), with the refusal's words;
//  - host state the graph depends on is declared instead: before_replay(fn) for an
//    input the graph reads from device memory and the host refreshes in place (the
//    router's bias), after_replay(fn) for a host handle to memory the graph writes
//    (the MoE layer's pending counts, the max logits of QK-Clip).
// Plain C++, no CUDA: the ops and layers include it in every build; the CUDA
// runtime (backend/cuda/graph.h) opens the scope around a capture and runs the hooks.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace moetrain::graph {

// Thrown by refuse_if_capturing: the step cannot be captured (what() says why).
class CaptureRefused : public Error {
 public:
  explicit CaptureRefused(const std::string& what) : Error(what) {}
};

// Whether this thread is capturing a graph now.
bool capturing();
// Throws CaptureRefused naming `what` (e.g. "a copy from the host to cuda:0") while
// this thread captures; nothing otherwise.
void refuse_if_capturing(const char* what);
// While capturing: fn runs before (after) every replay of the graph, in the order
// registered. Outside a capture: nothing (the eager step needs no hook).
void before_replay(std::function<void()> fn);
void after_replay(std::function<void()> fn);
// While capturing: `owner` (e.g. a Tensor's impl_ptr()) lives as long as the graph.
// For memory the graph reads that its holder may drop later (a table in a cache
// that evicts): a replay must never read a block the allocator gave to another.
void keep(std::shared_ptr<const void> owner);

struct ReplayHooks {
  std::vector<std::function<void()>> before, after;
  std::vector<std::shared_ptr<const void>> kept;
};

// Marks this thread as capturing for its lifetime and collects the hooks
// registered meanwhile (take() hands them over). Scopes do not nest.
class CaptureScope {
 public:
  CaptureScope();
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;
  ReplayHooks take();
};

}  // namespace moetrain::graph
