// A CUDA graph of the work one function queues on a device's stream (docs/cuda.md,
// "CUDA graphs"): captured once, replayed with one launch. The trainer captures the
// forward and backward of a single-GPU step with it (train/graph_step.h).
//
// The capture runs the function once with the stream capturing: its kernels are
// recorded, none executes. Its allocations come from a private pool of the caching
// allocator (caching_allocator.h), so a replay writes memory that nothing else is
// given while the graph lives. Host work a replay would not repeat refuses while
// capturing (core/graph_capture.h): the copies to and from the host, waits, random
// draws; the replay hooks the code registered run before and after each replay.
// Defined in runtime.cpp (runtime_disabled.cpp without CUDA: constructing one
// throws). No CUDA header here.
#pragma once

#include <cstdint>
#include <functional>

#include "core/graph_capture.h"

namespace moetrain::cuda {

class Graph {
 public:
  // Captures what body() queues on `device`'s stream. Throws graph::CaptureRefused
  // when body refuses or runs out of memory, or CUDA refuses a call made in it or the
  // graph; any other exception of body (a bug, a device fault) is rethrown as it is.
  // Either way the capture is ended, its pool returned and the stream usable eagerly.
  Graph(int device, const std::function<void()>& body);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // The before-replay hooks, one launch of the graph on the stream, the after-replay
  // hooks. Returns without waiting for the device.
  void replay();
  // Nodes of the captured graph (kernels, copies, memsets; -1 if CUDA would not say)
  // and the bytes of its pool.
  int64_t nodes() const { return nodes_; }
  int64_t pool_bytes() const;

 private:
  int device_ = -1;
  int pool_ = 0;
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
  int64_t nodes_ = 0;
  graph::ReplayHooks hooks_;
};

}  // namespace moetrain::cuda
