// train.cuda_graph (docs/cuda.md#cuda-graphs): the forward and backward of a
// single-GPU step captured once into a CUDA graph and replayed every later step, one
// launch instead of thousands.
//
// The batch goes into device buffers the graph reads (copied from the host before
// each replay); the gradients, the summed loss, the MoE layers' counts and the max
// logits are device tensors the graph writes, handed back to their owners after each
// replay (graph::after_replay, core/graph_capture.h). Before the graph is used, it is
// checked against the eager step on two inputs (this step's batch with its tokens
// rolled by one, then the batch itself): the loss, every gradient's norm, every MoE
// layer's counts and every max logit must agree (counts exactly, the rest within
// kGraphCheckTolerance), else auto falls back to eager steps with a warning and on
// stops the run. The step's result is the last replay's, on its own batch.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "data/loader.h"

namespace moetrain {

class LanguageModel;
namespace cuda {
class Graph;
}

enum class CudaGraphMode { off, on, auto_ };
CudaGraphMode parse_cuda_graph_mode(const std::string& name);  // auto | on | off

// Relative difference allowed between a replay and the eager step for the loss and
// each gradient norm (the same kernels in the same order: 0 expected; the bound
// leaves room for a library that sums in another order between calls).
inline constexpr double kGraphCheckTolerance = 1e-6;

class GraphStep {
 public:
  // body(ids, targets): queues the forward and backward of the micro-batches (device
  // tensors) and returns their summed loss, an f64 scalar on the device, unread.
  using Body = std::function<Tensor(const std::vector<Tensor>& ids, const std::vector<Tensor>& targets)>;
  GraphStep(LanguageModel& model, Device device, CudaGraphMode mode, Body body);
  ~GraphStep();

  // The step for these micro-batches (host tensors): after the capture and its check,
  // a replay; before, or where the shapes differ from the captured ones, or after a
  // fallback, the eager body on the host batch (as with train.cuda_graph off). Returns the summed loss
  // (device f64 scalar). `capture_now`: try to capture at this step (the trainer asks
  // from its second step on: the first allocates the lazily made buffers).
  Tensor run(const std::vector<data::Batch>& batches, bool capture_now);

  bool replaying() const { return graph_ != nullptr; }
  // One line for the log: "captured (1,234 nodes, 512 MiB pool), checked ..." or why not.
  const std::string& status() const { return status_; }

 private:
  struct Print;
  void upload(const std::vector<data::Batch>& batches);
  Tensor replay();
  Print print(const Tensor& loss_sum);
  void clear_step_state();
  bool capture_and_check(const std::vector<data::Batch>& batches);
  void give_up(const std::string& why);

  LanguageModel& model_;
  Device device_;
  CudaGraphMode mode_;
  Body body_;
  bool tried_ = false;
  std::vector<Tensor> ids_, targets_;  // the static inputs the graph reads
  std::unique_ptr<cuda::Graph> graph_;
  Tensor loss_sum_;                    // written by each replay
  std::vector<Tensor> grads_;          // each parameter's gradient the graph writes (undefined: none)
  std::string status_ = "not captured";
};

}  // namespace moetrain
