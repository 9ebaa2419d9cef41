// MoE token dispatch (docs/parallelism.md, "A token's path"): the rows a layer
// routes, sorted by global expert, go to the rank that holds their expert, run
// there, and come back in their order. One interface, so that another exchange
// (hierarchical, overlapped, DeepEP-style) is one more class:
//   LocalDispatcher     every expert on this process: the rows stay
//   AllToAllDispatcher  experts split over an expert-parallel group in contiguous
//                       ranges: one all_to_all_v there and back (autograd: the
//                       backward is the reverse exchange), the received rows
//                       re-grouped by local expert in between
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

namespace comm {
class Communicator;
}

class Dispatcher {
 public:
  // Runs this rank's experts on rows grouped by local expert (rows per local expert given).
  using ExpertsFn = std::function<Tensor(const Tensor& rows, const std::vector<int64_t>& local_counts)>;
  virtual ~Dispatcher() = default;
  // rows_sorted [M, W]: counts[e] rows for each global expert e (all E), in expert
  // order. Returns experts' output for those rows, in the same order.
  virtual Tensor dispatch(const Tensor& rows_sorted, const std::vector<int64_t>& counts,
                          const ExpertsFn& experts) const = 0;
};

class LocalDispatcher : public Dispatcher {
 public:
  Tensor dispatch(const Tensor& rows_sorted, const std::vector<int64_t>& counts,
                  const ExpertsFn& experts) const override;
};

class AllToAllDispatcher : public Dispatcher {
 public:
  // group: the expert-parallel group (rank r holds experts [r·E/P, (r+1)·E/P)); it
  // must outlive the dispatcher and the graphs of its exchanges.
  AllToAllDispatcher(comm::Communicator& group, int64_t num_experts);
  Tensor dispatch(const Tensor& rows_sorted, const std::vector<int64_t>& counts,
                  const ExpertsFn& experts) const override;

 private:
  comm::Communicator& group_;
  int64_t num_experts_;
  mutable bool logged_sizes_ = false;  // the first exchange's sizes go to the debug log
};

}  // namespace moetrain
